"""Per-module health and numerical checks of a DoRA adapter.

Check ids (severity):
  structure.missing (error)     A, B or the magnitude is absent
  structure.dtype (error)       a tensor is not fp16, bf16, fp32 or fp64 (integer, bool, fp8, ...)
  structure.shape (error)       A (r, d_in), B (d_out, r), m (d_out,), W (d_out, d_in) disagree, or a dim is 0
  structure.rank (error)        r differs from adapter_config.json (r / rank_pattern)
  config.missing (warning)      no adapter_config.json: scaling unknown, numerics skipped
  finite.<tensor> (error)       NaN / Inf entries, counted per tensor
  magnitude.nonpositive (error) entries <= 0 (a zero kills the feature, a negative flips it)
  magnitude.tiny (warning)      entries below 1e-6 of the median
  base.missing (info/warning)   no --base (info) / this module's weight not in the base (warning)
  norm.zero (warning)           ||W + s·B·A|| = 0 rows: PEFT's DoRA gives NaN there
  norm.near_zero (warning)      rows below 1e-6 of the median norm
  norm.cancellation (warning)   (base + 2s|cross| + s²·lora) / n² > 1e3: W cancels s·B·A
  norm.terms (info)             the three terms and the norm
  scale.stats (info)            g = m / n statistics
  base.mismatch (error)         the magnitudes do not follow this base's row norms (``_base_agreement``)
  base.inconclusive (info)      the rows cannot tell bases apart (norms of one size, or s·B·A dominates W)
  scale.collapse_bf16/fp16 (info) share of the features above the noise floor whose g rounds to 1
  overflow.fp16/bf16 (warning/error) merged |W'_ij| <= m_i: headroom to the dtype's max
  merge.ulp (info/warning)      merged output error in ulps of W's dtype (fp32 for fp64) and against its bound
                                (``check_merge``); warning: median > 8 ulp or bound exceeded
  structure.not_dora (info)     a plain LoRA module (no magnitude, use_dora not true)
  format.kohya (info)           kohya/LyCORIS dora_scale: a different norm axis, not audited numerically
  memory (info)                 the norm's scratch: a dense fp32 d_out×d_in against the factored terms

``keep_arrays``: per-feature vectors in ``ModuleReport.arrays``, for plots (not in the JSON)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from doracheck.kernels.constants import EPS
from doracheck.reference import ulp_error

from .discovery import ModuleKeys

CANCELLATION_LIMIT = 1e3
PROBE_TOKENS = 8
ROW_BLOCK = 512
MERGE_MEDIAN_ULP_LIMIT = 8.0
NOISE_ULPS = 2  # learned |g-1| must exceed this many ulps of the magnitude's precision (plus the norm's rounding)
# base.mismatch (``_base_agreement``): thresholds on the agreement of m with the base's row norms.
MISMATCH_MEDIAN_G = 0.02  # median |g-1| above this: the magnitudes are not (near) PEFT's init for this base
MISMATCH_EXCESS = 0.25  # corr(m, n) must beat corr(m, n with the base's rows shifted) by at least this
MISMATCH_INFORMATIVE = 0.5  # the base's rows matter: corr(n, n shifted) below this
MISMATCH_SPREAD = 0.5  # and their norms spread: std(n)/mean(n) at least this times median |g-1|
SIXTEEN_BIT = ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))


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
    arrays: dict = field(default_factory=dict, repr=False)  # per-feature vectors for plots (keep_arrays)
    keep_arrays: bool = False

    def add(self, id_: str, severity: str, message: str) -> None:
        self.checks.append(Check(id_, severity, message))

    def count(self, severity: str) -> int:
        return sum(c.severity == severity for c in self.checks)

    def as_dict(self) -> dict:
        return {
            "name": self.name, "format": self.fmt, "r": self.r, "d_in": self.d_in, "d_out": self.d_out,
            "scaling": self.scaling, "checks": [c.__dict__ for c in self.checks], **self.stats,
        }


def _finite(report: ModuleReport, role: str, t: torch.Tensor) -> bool:
    if bool(torch.isfinite(t).all()):
        return True
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    if nan or inf:
        report.add(f"finite.{role}", "error", f"{role}: {nan} NaN and {inf} Inf of {t.numel()} entries")
        return False
    return True


def check_structure(report: ModuleReport, tensors: dict[str, torch.Tensor], configured_r: int | None, dora: bool = True) -> bool:
    """Shapes, dtypes, rank (and the magnitude when ``dora``); True when the numerical checks can run."""
    A, B, m = tensors.get("A"), tensors.get("B"), tensors.get("magnitude")
    roles = (("lora_A", A), ("lora_B", B), ("magnitude", m)) if dora else (("lora_A", A), ("lora_B", B))
    missing = [role for role, t in roles if t is None]
    if missing:
        report.add("structure.missing", "error", f"missing {', '.join(missing)}")
        return False
    assert A is not None and B is not None
    ok = True
    for role, t in roles:
        assert t is not None
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            report.add("structure.dtype", "error", f"{role}: expected a floating dtype, got {t.dtype}")
            ok = False
    if A.dim() != 2 or B.dim() != 2:
        report.add("structure.shape", "error", f"lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} must be 2-D")
        return False
    r, d_in = A.shape
    d_out = B.shape[0]
    report.r, report.d_in, report.d_out = int(r), int(d_in), int(d_out)
    if 0 in (r, d_in, d_out):  # nothing to compute a norm, a scale or a merge over
        report.add("structure.shape", "error", f"empty module: r = {r}, d_in = {d_in}, d_out = {d_out} (lora_A "
                   f"{tuple(A.shape)}, lora_B {tuple(B.shape)}); every dimension must be at least 1")
        ok = False
    if B.shape[1] != r:
        report.add("structure.shape", "error", f"lora_B: expected shape ({d_out}, {r}) (r of lora_A), got {tuple(B.shape)}")
        ok = False
    if m is not None and tuple(m.shape) != (d_out,):
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


def magnitude_precision(m: torch.Tensor) -> tuple[str, float]:
    """(name, eps) of the magnitudes' precision: the narrowest of bf16 / fp16 holding every value exactly
    (PEFT's init on a 16-bit base rounds the norm to it, then stores fp32), else the storage; at most fp32."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if m.dtype in names:
        return names[m.dtype], torch.finfo(m.dtype).eps
    m32 = m.float()
    if m32.numel() and bool(torch.isfinite(m32).all()):
        for dtype, name in SIXTEEN_BIT:
            if bool((m32.to(dtype).float() == m32).all()):
                return name, torch.finfo(dtype).eps
    return "fp32", torch.finfo(torch.float32).eps


def noise_floor(m: torch.Tensor, indicator: torch.Tensor, d_in: int) -> torch.Tensor:
    """Per feature, the |g - 1| rounding alone can give (fp64): NOISE_ULPS ulps of the magnitudes' precision
    plus the factored norm's fp32 rounding eps32·(2 + log2 d_in)·κ (κ: ``_norm_findings``' indicator)."""
    _, eps_m = magnitude_precision(m)
    eps32 = torch.finfo(torch.float32).eps
    return NOISE_ULPS * eps_m + eps32 * (2 + math.log2(max(d_in, 1))) * indicator.double()


def collapse_stats(report: ModuleReport, g: torch.Tensor, floor: torch.Tensor, precision: str) -> None:
    """Share of the learned features (|g - 1| above the noise floor) whose g rounds to 1 in bf16 / fp16."""
    dev = (g.double() - 1).abs()
    learned = dev > floor
    k = int(learned.sum())
    report.stats["g"].update(learned=k, noise_floor_median=float(floor.median()), magnitude_precision=precision)
    for dtype, name in SIXTEEN_BIT:
        lost = int((learned & (g.to(dtype) == 1)).sum())
        frac = lost / k if k else 0.0
        report.stats[f"collapse_{name}"] = frac
        if k:
            message = (f"{lost} of the {k} features with a learned g != 1 ({100 * frac:.1f}%) round to exactly 1 in {name}: "
                       f"a compose that rounds g to {name} drops their learned magnitude")
        else:
            message = (f"no feature has |g-1| above the rounding noise (median {float(floor.median()):.2g}; magnitudes hold "
                       f"{precision} precision): nothing learned for {name} to drop (a fresh adapter)")
        report.add(f"scale.collapse_{name}", "info", message)


def _norm_findings(report: ModuleReport, base, cross, lora, n, s: float) -> torch.Tensor:
    """Zero, near-zero and cancelling rows; returns the cancellation indicator κ per row."""
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
            "norm.cancellation", "warning",
            f"{cancelling} rows where W cancels s·B·A ((||W||² + 2s|<W,BA>| + s²||BA||²)/n² up to {float(indicator.max()):.3g}): "
            "n carries fewer significant digits there",
        )
    return torch.where(n > 0, indicator, torch.ones_like(indicator))


def correlation(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Pearson correlation of two vectors in fp64 (None when either is constant or has < 3 entries)."""
    a, b = a.double().flatten(), b.double().flatten()
    if a.numel() < 3:
        return None
    a, b = a - a.mean(), b - b.mean()
    scale = float(a.norm() * b.norm())
    return float((a * b).sum()) / scale if scale > 0 else None


def _base_agreement(report: ModuleReport, m: torch.Tensor, n: torch.Tensor, n_shifted: torch.Tensor, median_g: float) -> None:
    """``base.mismatch``: do the magnitudes belong to this base? PEFT initialises m = ||W + s·B·A|| per row
    (g = 1) and training moves each m_i by a relative δ_i, so m follows the base's row norms n. The base's
    rows shifted by half (``n_shifted``: W's row i with B·A's row i + d_out/2) are a right-shaped base whose
    rows are not m's. With the right base, corr(m, n) - corr(m, n_shifted) ≈ c / sqrt(c² + var δ) for row
    norms spreading by a relative c (less a shuffle's noise 1/sqrt(d_out)); another seed's base gives ≈ 0
    and a median |g-1| of order c. The rows must carry information: norms that spread (c >= 0.5·median
    |g-1|; an orthogonal init's equal norms cannot) and rows that matter (corr(n, n_shifted) < 0.5; an
    s·B·A dominating W makes all bases alike), else ``base.inconclusive``. It fires if m is off PEFT's init
    (median |g-1| > 0.02) and the excess is below 0.25. Tiny LLaMA, 100 steps (fp32, bf16): excess 0.41-1.1
    with its base, -0.32 to 0.23 with another seed's (tests/audit/test_audit_base.py)."""
    rho, rho_shifted, informative = correlation(m.cpu(), n), correlation(m.cpu(), n_shifted), correlation(n, n_shifted)
    excess = None if rho is None or rho_shifted is None else rho - rho_shifted
    spread = float(n.std() / n.mean()) if n.numel() > 1 and float(n.mean()) > 0 else 0.0
    report.stats["base_agreement"] = {"correlation": rho, "correlation_shifted": rho_shifted, "excess": excess,
                                      "rows_matter": informative, "norm_spread": spread, "median_abs_g_minus_1": median_g}
    if median_g <= MISMATCH_MEDIAN_G:
        return
    if informative is None or informative >= MISMATCH_INFORMATIVE or spread < MISMATCH_SPREAD * median_g:
        report.add("base.inconclusive", "info", f"the base's rows barely tell bases apart here (row norms spread by {spread:.2g} "
                   f"against a median |g-1| of {median_g:.2g}, or s·B·A dominates W): whether the magnitudes belong to this "
                   "base cannot be told")
    elif excess is None or excess < MISMATCH_EXCESS:
        shown = "undefined" if excess is None else f"{excess:.2f}"
        report.add("base.mismatch", "error",
                   f"the magnitudes do not follow this base's row norms: corr(m, n) beats a row-shifted base by {shown} "
                   f"(< {MISMATCH_EXCESS}) with median |g-1| {median_g:.3g}: is --base the model this adapter was trained on?")


def _overflow_findings(report: ModuleReport, m: torch.Tensor) -> None:
    peak = float(m.double().abs().max()) if m.numel() else 0.0
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        limit = torch.finfo(dtype).max
        headroom = math.log2(limit / peak) if peak > 0 else math.inf
        report.stats[f"headroom_bits_{name}"] = headroom if math.isfinite(headroom) else None
        if headroom < 0:
            report.add(f"overflow.{name}", "error", f"max |m| = {peak:.4g} exceeds the {name} maximum: a merged {name} weight overflows")
        elif headroom < 1:
            report.add(f"overflow.{name}", "warning", f"max |m| = {peak:.4g}: less than 1 bit of {name} headroom for merged weights")


def check_norm_and_scale(report: ModuleReport, W, A, B, m, scaling: float, fan_in_fan_out: bool, device) -> torch.Tensor:
    """Factored norm terms, cancellation, near-zero rows, g stats, collapse, overflow headroom; returns g."""
    import doracheck
    terms = doracheck.factored_norm(W.to(device), A.to(device), B.to(device), scaling, fan_in_fan_out=fan_in_fan_out, return_terms=True)
    assert isinstance(terms, doracheck.NormTerms)
    base, cross, lora, n = (t.double().cpu() for t in terms)
    report.norm = terms.norm.cpu()
    s = float(scaling)
    report.add(
        "norm.terms", "info",
        f"||W||² median {float(base.median()):.4g}, <W,BA> median {float(cross.median()):.3g}, "
        f"||BA||² median {float(lora.median()):.3g}, n in [{float(n.min()):.4g}, {float(n.max()):.4g}]",
    )
    indicator = _norm_findings(report, base, cross, lora, n, s)
    g = m.float().cpu() / torch.clamp_min(terms.norm.float().cpu(), EPS)
    dev = (g.double() - 1).abs()
    report.stats["g"] = {"min": float(g.min()), "median": float(g.median()), "max": float(g.max()), "median_abs_g_minus_1": float(dev.median())}
    report.add("scale.stats", "info", f"g = m/n in [{float(g.min()):.4g}, {float(g.max()):.4g}], median |g-1| {float(dev.median()):.3g}")
    shift = n.shape[0] // 2
    shifted = W.roll(shift, dims=1 if fan_in_fan_out else 0)
    n_shifted = doracheck.factored_norm(shifted.to(device), A.to(device), B.to(device), scaling, fan_in_fan_out=fan_in_fan_out)
    assert isinstance(n_shifted, torch.Tensor)
    _base_agreement(report, m, n, n_shifted.double().cpu(), float(dev.median()))
    precision, _ = magnitude_precision(m)
    floor = noise_floor(m, indicator, int(A.shape[1]))
    collapse_stats(report, g, floor, precision)
    _overflow_findings(report, m)
    if report.keep_arrays:
        report.arrays.update(g_minus_1=(g.double() - 1).numpy(), noise_floor=floor.numpy(), base=base.numpy(),
                             cross_2s=(2 * s * cross).numpy(), lora_s2=(s * s * lora).numpy())
    return g


def ulp_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose ulps measure the merge error: W's, but never finer than fp32, the
    precision the merge is computed in (an fp64 W holds an fp32-accurate merged weight)."""
    return dtype if torch.finfo(dtype).bits <= 32 else torch.float32


def _merge_block(x, xa, W_blk, B_blk, g_blk, A, s: float, dtype):
    """(ulp errors, error / a-priori bound) of one row block's outputs; exact output and bound factored."""
    g64 = g_blk.double()
    W64 = W_blk.double()
    B64 = B_blk.double()
    exact_out = g64 * (x @ W64.t() + s * (xa @ B64.t()))
    merged = (g_blk.float()[:, None] * (W_blk.float() + s * (B_blk.float() @ A.float()))).to(dtype)
    approx = x @ merged.double().t()
    ulps = ulp_error(approx.to(ulp_dtype(dtype)), exact_out)
    # one rounding to dtype (unit roundoff u) after an fp32 merge (r + 4 fp32 roundings at most)
    u = torch.finfo(dtype).eps / 2 + (A.shape[0] + 4) * torch.finfo(torch.float32).eps / 2
    x_abs = x.abs()
    bound = u * g64.abs() * (x_abs @ W64.abs().t() + abs(s) * ((x_abs @ A.double().abs().t()) @ B64.abs().t()))
    ratio = (approx - exact_out).abs() / torch.clamp_min(bound, torch.finfo(torch.float64).tiny)
    ratio = torch.where(torch.isfinite(approx), ratio, torch.full_like(ratio, math.inf))
    return ulps.flatten().cpu(), ratio.flatten().cpu()


def check_merge(report: ModuleReport, W, A, B, g, scaling: float, fan_in_fan_out: bool, device, seed: int = 0) -> None:
    """Probe x (8 tokens): x·W'ᵀ, W' = g ⊙ (W + s·B·A) in fp32 cast to W's dtype, against the exact fp64 merge
    in ulps of ``ulp_dtype`` and against the a-priori bound of one rounding after an fp32 merge,
    |x|·(u·|g|·(|W| + |s|·|B|·|A|))ᵀ: a ratio above 1 means merged entries lost more than rounding allows
    (overflow, subnormals). Row blocks keep memory at O(ROW_BLOCK·d_in)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(PROBE_TOKENS, A.shape[1], generator=gen, dtype=torch.float64).to(device)
    rows = W.t() if fan_in_fan_out else W
    A_dev = A.to(device)
    xa = x @ A_dev.double().t()
    dtype = W.dtype if W.is_floating_point() else torch.float32
    ulps, ratios = [], []
    for start in range(0, rows.shape[0], ROW_BLOCK):
        stop = min(start + ROW_BLOCK, rows.shape[0])
        u_blk, r_blk = _merge_block(x, xa, rows[start:stop].to(device), B[start:stop].to(device), g[start:stop].to(device),
                                    A_dev, float(scaling), dtype)
        ulps.append(u_blk)
        ratios.append(r_blk)
    err = torch.cat(ulps) if ulps else torch.zeros(1)
    ratio = torch.cat(ratios) if ratios else torch.zeros(1)
    finite = err[torch.isfinite(err)]
    median = float(finite.median()) if finite.numel() else float("inf")
    worst = float(err.max()) if err.numel() else 0.0
    worst_ratio = float(ratio.max()) if ratio.numel() else 0.0
    report.stats["merge_ulp"] = {"median": median, "max": worst, "max_vs_bound": worst_ratio}
    if report.keep_arrays:
        report.arrays["merge_ulp"] = err.numpy()
    name = str(dtype).replace("torch.", "")
    unit = "" if ulp_dtype(dtype) == dtype else " (ulps of float32, the precision of the merge)"
    message = (f"merged {name} weight vs the exact merge: output error median {median:.2f} ulp, max {worst:.1f} ulp{unit}, "
               f"at most {worst_ratio:.2g}× the rounding bound")
    if median > MERGE_MEDIAN_ULP_LIMIT or not worst_ratio <= 1:
        report.add("merge.ulp", "warning", message + f" (warning: median above {MERGE_MEDIAN_ULP_LIMIT:g} ulp or the bound exceeded)")
    else:
        report.add("merge.ulp", "info", message)


def check_memory(report: ModuleReport, d_out: int, d_in: int, r: int, device, lora_A_dtype: torch.dtype | None = None,
                 lora_B_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None) -> None:
    """The norm's scratch in fp32, W excluded: a dense norm holds at least V = W + s·B·A (d_out×d_in; PEFT's
    eager path also B·A), the factored one U = W·Aᵀ (d_out×r), G = A·Aᵀ (r×r) and four d_out vectors.
    ``implementation_bound``: all doracheck's kernels on this device's path allocate for these adapters on
    a ``weight_dtype`` base (unknown: the larger of bf16 and fp16, until ``update_memory_bound`` knows)."""
    dense = 4 * d_out * d_in
    factored = 4 * (d_out * r + r * r + 4 * d_out)
    report.stats["memory_bytes"] = {"dense_norm": dense, "factored_norm": factored, "dtype": "fp32"}
    update_memory_bound(report, d_out, d_in, r, device, lora_A_dtype, lora_B_dtype, weight_dtype)
    report.add("memory", "info", f"norm scratch in fp32 (W excluded): dense V = W + s·B·A {format_bytes(dense)}, "
               f"factored terms {format_bytes(factored)}")


def update_memory_bound(report: ModuleReport, d_out: int, d_in: int, r: int, device, lora_A_dtype: torch.dtype | None,
                        lora_B_dtype: torch.dtype | None, weight_dtype: torch.dtype | None) -> None:
    """``stats["memory_bytes"]``'s ``implementation_bound``, ``path``, ``base_dtype`` (``check_memory``)."""
    from doracheck.dispatch import choose_path
    from doracheck.kernels import norm_memory_bound
    from doracheck.kernels.settings import cublas_cross_pieces, triton_norm_memory_bound
    path = choose_path(torch.device(device)).name
    if path == "triton":
        bases = (weight_dtype,) if weight_dtype is not None else (torch.bfloat16, torch.float16)
        split = lora_A_dtype is not None and any(cublas_cross_pieces(w, lora_A_dtype) == 2 for w in bases)
        bound = triton_norm_memory_bound(d_out, d_in, r, lora_B_dtype, split_adapters=split)
    else:
        bound = norm_memory_bound(d_out, d_in, r)
    report.stats["memory_bytes"].update(implementation_bound=bound, path=path,
                                        base_dtype=None if weight_dtype is None else str(weight_dtype).replace("torch.", ""))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def note_kohya(report: ModuleReport, keys: ModuleKeys, tensors: dict[str, torch.Tensor]) -> None:
    mag = tensors.get("magnitude")
    A, B = tensors.get("A"), tensors.get("B")
    axis = "unknown"
    if mag is not None and A is not None and B is not None and A.dim() == 2 and B.dim() == 2:
        report.r, report.d_in, report.d_out = int(A.shape[0]), int(A.shape[1]), int(B.shape[0])
        if mag.numel() == A.shape[1] and (mag.dim() <= 1 or mag.shape[0] == 1):
            axis = "per input feature (column norm, LyCORIS default)"
        elif mag.numel() == B.shape[0]:
            axis = "per output feature (row norm, wd_on_output)"
    report.add(
        "format.kohya", "info",
        f"kohya/LyCORIS naming (lora_down/lora_up/dora_scale): dora_scale {tuple(mag.shape) if mag is not None else None} "
        f"normalises {axis}; PEFT's row-norm numerics are not applied to it",
    )
