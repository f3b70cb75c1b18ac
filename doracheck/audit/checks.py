"""Per-module health and numerical checks of a DoRA adapter.

Check ids (severity):
  structure.missing (error)     A, B or the magnitude is absent
  structure.dtype (error)       a tensor is not floating point
  structure.shape (error)       A (r, d_in), B (d_out, r), m (d_out,), W (d_out, d_in) disagree
  structure.rank (error)        r differs from adapter_config.json (r / rank_pattern)
  config.missing (warning)      no adapter_config.json: scaling unknown, numerics skipped
  finite.<tensor> (error)       NaN / Inf entries, counted per tensor
  magnitude.nonpositive (error) entries <= 0 (a zero kills the feature, a negative flips it)
  magnitude.tiny (warning)      entries below 1e-6 of the median
  base.missing (info)           no base weights given or found: norm checks skipped
  norm.zero (warning)           ||W + s·B·A|| = 0 rows: PEFT's DoRA gives NaN there
  norm.near_zero (warning)      rows below 1e-6 of the median norm
  norm.cancellation (warning)   (base + 2s|cross| + s²·lora) / n² > 1e3: W cancels s·B·A
  norm.terms (info)             the three terms and the norm
  scale.stats (info)            g = m / n statistics
  scale.collapse_bf16/fp16 (info) features with g != 1 that round to exactly 1 in that dtype
  overflow.fp16/bf16 (warning/error) merged |W'_ij| <= m_i: headroom to the dtype's max
  merge.ulp (info/warning)      merged-weight output vs the unmerged DoRA forward, in ulps
  format.kohya (info)           kohya/LyCORIS dora_scale: a different norm axis, not audited numerically
  memory (info)                 what a dense norm allocates against the factored norm
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from doracheck.kernels.constants import EPS
from doracheck.reference import ulp_error

from .discovery import ModuleKeys

CANCELLATION_LIMIT = 1e3
PROBE_TOKENS = 8
ROW_BLOCK = 1024


@dataclass
class Check:
    id: str
    severity: str  # error | warning | info
    message: str


@dataclass
class ModuleReport:
    name: str
    fmt: str
    r: int | None = None
    d_in: int | None = None
    d_out: int | None = None
    scaling: float | None = None
    checks: list[Check] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    norm: torch.Tensor | None = None  # fp32 (d_out,) when computed (kept for the Python API)

    def add(self, id_: str, severity: str, message: str) -> None:
        self.checks.append(Check(id_, severity, message))

    def count(self, severity: str) -> int:
        return sum(c.severity == severity for c in self.checks)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "format": self.fmt,
            "r": self.r,
            "d_in": self.d_in,
            "d_out": self.d_out,
            "scaling": self.scaling,
            "checks": [c.__dict__ for c in self.checks],
            **self.stats,
        }


def _finite(report: ModuleReport, role: str, t: torch.Tensor) -> bool:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    if nan or inf:
        report.add(f"finite.{role}", "error", f"{role}: {nan} NaN and {inf} Inf of {t.numel()} entries")
        return False
    return True


def check_structure(report: ModuleReport, tensors: dict[str, torch.Tensor], configured_r: int | None) -> bool:
    """Shapes, dtypes, rank; True when the numerical checks can run."""
    A, B, m = tensors.get("A"), tensors.get("B"), tensors.get("magnitude")
    missing = [role for role, t in (("lora_A", A), ("lora_B", B), ("magnitude", m)) if t is None]
    if missing:
        report.add("structure.missing", "error", f"missing {', '.join(missing)}")
        return False
    assert A is not None and B is not None and m is not None
    ok = True
    for role, t in (("lora_A", A), ("lora_B", B), ("magnitude", m)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            report.add("structure.dtype", "error", f"{role}: expected a floating dtype, got {t.dtype}")
            ok = False
    if A.dim() != 2 or B.dim() != 2:
        report.add("structure.shape", "error", f"lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} must be 2-D")
        return False
    r, d_in = A.shape
    d_out = B.shape[0]
    report.r, report.d_in, report.d_out = int(r), int(d_in), int(d_out)
    if B.shape[1] != r:
        report.add("structure.shape", "error", f"lora_B: expected shape ({d_out}, {r}) (r of lora_A), got {tuple(B.shape)}")
        ok = False
    if tuple(m.shape) != (d_out,):
        report.add("structure.shape", "error", f"magnitude: expected shape ({d_out},), got {tuple(m.shape)}")
        ok = False
    if configured_r is not None and configured_r != r:
        report.add("structure.rank", "error", f"r = {r} in the tensors, {configured_r} in the config")
        ok = False
    return ok


def check_magnitude(report: ModuleReport, m: torch.Tensor) -> None:
    m64 = m.double()
    nonpos = int((m64 <= 0).sum())
    if nonpos:
        report.add("magnitude.nonpositive", "error", f"{nonpos} of {m.numel()} magnitude entries are <= 0 (min {float(m64.min()):.3g})")
    positive = m64[m64 > 0]
    if positive.numel():
        median = float(positive.median())
        tiny = int(((m64 > 0) & (m64 < 1e-6 * median)).sum())
        if tiny:
            report.add("magnitude.tiny", "warning", f"{tiny} magnitude entries below 1e-6 of the median {median:.3g}")


def _collapse_fraction(g: torch.Tensor, dtype: torch.dtype) -> float:
    moved = g != 1
    collapsed = moved & (g.to(dtype) == 1)
    return float(collapsed.sum()) / max(g.numel(), 1)


def check_norm_and_scale(report: ModuleReport, W, A, B, m, scaling: float, fan_in_fan_out: bool, device) -> torch.Tensor:
    """Norm terms by the factored kernel, cancellation, near-zero rows, g statistics,
    collapse zones and overflow headroom. Returns g (fp32)."""
    import doracheck

    terms = doracheck.factored_norm(W.to(device), A.to(device), B.to(device), scaling, fan_in_fan_out=fan_in_fan_out, return_terms=True)
    assert isinstance(terms, doracheck.NormTerms)
    base, cross, lora, n = (t.double().cpu() for t in terms)
    report.norm = terms.norm.cpu()
    s = float(scaling)
    report.add(
        "norm.terms",
        "info",
        f"||W||² median {float(base.median()):.4g}, <W,BA> median {float(cross.median()):.3g}, "
        f"||BA||² median {float(lora.median()):.3g}, n in [{float(n.min()):.4g}, {float(n.max()):.4g}]",
    )
    report.stats["norm"] = {"min": float(n.min()), "median": float(n.median()), "max": float(n.max())}
    zero = int((n == 0).sum())
    if zero:
        report.add("norm.zero", "warning", f"{zero} rows have ||W + s·B·A|| = 0: PEFT's DoRA gives NaN there, doracheck gives 0")
    positive = n[n > 0]
    if positive.numel():
        near = int(((n > 0) & (n < 1e-6 * float(positive.median()))).sum())
        if near:
            report.add("norm.near_zero", "warning", f"{near} rows have a norm below 1e-6 of the median")
    magnitude_sum = base + 2 * abs(s) * cross.abs() + s * s * lora
    indicator = magnitude_sum / torch.clamp_min(n * n, 1e-300)
    cancelling = int((indicator > CANCELLATION_LIMIT).sum())
    report.stats["cancellation_max"] = float(indicator.max()) if indicator.numel() else 0.0
    if cancelling:
        report.add(
            "norm.cancellation",
            "warning",
            f"{cancelling} rows where W cancels s·B·A ((||W||² + 2s|<W,BA>| + s²||BA||²)/n² up to {float(indicator.max()):.3g}): "
            "n carries fewer significant digits there",
        )
    g = m.float().cpu() / torch.clamp_min(terms.norm.float().cpu(), EPS)
    dev = (g.double() - 1).abs()
    report.stats["g"] = {"min": float(g.min()), "median": float(g.median()), "max": float(g.max()), "median_abs_g_minus_1": float(dev.median())}
    report.add("scale.stats", "info", f"g = m/n in [{float(g.min()):.4g}, {float(g.max()):.4g}], median |g-1| {float(dev.median()):.3g}")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        frac = _collapse_fraction(g, dtype)
        report.stats[f"collapse_{name}"] = frac
        report.add(
            f"scale.collapse_{name}",
            "info",
            f"{100 * frac:.1f}% of features have g != 1 but round to exactly 1 in {name}: a naive {name} compose drops their magnitude",
        )
    peak = float(m.double().abs().max()) if m.numel() else 0.0
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        limit = torch.finfo(dtype).max
        headroom = math.log2(limit / peak) if peak > 0 else math.inf
        report.stats[f"headroom_bits_{name}"] = headroom if math.isfinite(headroom) else None
        if headroom < 0:
            report.add(f"overflow.{name}", "error", f"max |m| = {peak:.4g} exceeds the {name} maximum: a merged {name} weight overflows")
        elif headroom < 1:
            report.add(f"overflow.{name}", "warning", f"max |m| = {peak:.4g}: less than 1 bit of {name} headroom for merged weights")
    return g


def check_merge(report: ModuleReport, W, A, B, g, scaling: float, fan_in_fan_out: bool, device, seed: int = 0) -> None:
    """Probe x (8 tokens): x·W'ᵀ with W' = g ⊙ (W + s·B·A) computed in fp32 and cast to W's
    dtype, against the unmerged DoRA forward b + g⊙(x·Wᵀ + s·(x·Aᵀ)·Bᵀ) in fp64, in ulps of
    W's dtype. Row blocks keep memory at O(ROW_BLOCK·d_in)."""
    gen = torch.Generator().manual_seed(seed)
    d_in = A.shape[1]
    x = torch.randn(PROBE_TOKENS, d_in, generator=gen, dtype=torch.float64).to(device)
    rows = W.t() if fan_in_fan_out else W
    A64 = A.to(device, torch.float64)
    xa = x @ A64.t()
    s = float(scaling)
    errors = []
    for start in range(0, rows.shape[0], ROW_BLOCK):
        stop = min(start + ROW_BLOCK, rows.shape[0])
        W_blk = rows[start:stop].to(device)
        B_blk = B[start:stop].to(device)
        g_blk = g[start:stop].to(device)
        exact = g_blk.double() * (x @ W_blk.double().t() + s * (xa @ B_blk.double().t()))
        merged = (g_blk[:, None] * (W_blk.float() + s * (B_blk.float() @ A.to(device).float()))).to(W.dtype)
        approx = x @ merged.double().t()
        errors.append(ulp_error(approx.to(W.dtype if W.is_floating_point() else torch.float32), exact).flatten().cpu())
    err = torch.cat(errors) if errors else torch.zeros(1)
    finite = err[torch.isfinite(err)]
    median = float(finite.median()) if finite.numel() else float("inf")
    worst = float(err.max()) if err.numel() else 0.0
    report.stats["merge_ulp"] = {"median": median, "max": worst}
    severity = "warning" if median > 8 else "info"
    report.add("merge.ulp", severity, f"merged {str(W.dtype).replace('torch.', '')} weight vs unmerged forward: median {median:.2f} ulp, max {worst:.1f} ulp")


def check_memory(report: ModuleReport, d_out: int, d_in: int, r: int, device) -> tuple[int, int]:
    """Extra memory of the norm: dense (B·A and W + s·B·A in fp32, as an eager norm forms them)
    against doracheck's factored norm on the path this device takes (Triton on CUDA)."""
    from doracheck.dispatch import choose_path
    from doracheck.kernels import norm_memory_bound
    from doracheck.kernels.settings import triton_norm_memory_bound

    dense = d_out * d_in * 4 * 2
    path = choose_path(torch.device(device)).name
    ours = triton_norm_memory_bound(d_out, d_in, r) if path == "triton" else norm_memory_bound(d_out, d_in, r)
    report.stats["memory_bytes"] = {"dense_norm": dense, "factored_norm": ours, "path": path}
    report.add("memory", "info", f"dense norm {dense / 2**20:.2f} MiB, factored norm ({path} path) {ours / 2**20:.2f} MiB")
    return dense, ours


def note_kohya(report: ModuleReport, keys: ModuleKeys, tensors: dict[str, torch.Tensor]) -> None:
    mag = tensors.get("magnitude")
    A, B = tensors.get("A"), tensors.get("B")
    axis = "unknown"
    if mag is not None and A is not None and B is not None and A.dim() == 2 and B.dim() == 2:
        report.r, report.d_in, report.d_out = int(A.shape[0]), int(A.shape[1]), int(B.shape[0])
        if mag.numel() == A.shape[1] and (mag.dim() == 1 or mag.shape[0] == 1):
            axis = "per input feature (column norm, LyCORIS default)"
        elif mag.numel() == B.shape[0]:
            axis = "per output feature (row norm, wd_on_output)"
    report.add(
        "format.kohya",
        "info",
        f"kohya/LyCORIS naming (lora_down/lora_up/dora_scale): dora_scale {tuple(mag.shape) if mag is not None else None} "
        f"normalises {axis}; PEFT's row-norm numerics are not applied to it",
    )
