"""The audit's summary table, its legend and the memory line, as plain data shared by the text
output of ``doracheck audit`` and its HTML report (``--report``)."""

from __future__ import annotations

from . import AuditReport
from .checks import MERGE_MEDIAN_ULP_LIMIT, NOISE_ULPS, ModuleReport, format_bytes

HEADER = ("module", "r", "d_in→d_out", "s", "err", "warn", "n range", "med |g-1|", "g≠1", "bf16→1", "fp16→1", "merge ulp",
          "merge/bound")
STRUCTURE_COLUMNS = 6  # module .. warn: all a plain LoRA adapter has

LEGEND = (
    ("module", "the adapted layer as named in the base model, in numeric order (layers.2 before layers.10)."),
    ("r, d_in→d_out, s", "rank, layer shape (A is r×d_in, B is d_out×r) and scaling s = lora_alpha/r (alpha/sqrt(r) under "
     "rsLoRA; rank_pattern/alpha_pattern per module); '?' when unknown."),
    ("err, warn", "findings of that severity, listed under 'findings' (--verbose adds the info ones). Any error makes the exit "
     "code 1; with --strict any warning does too."),
    ("n range", "min..max over features of the row norm n = ||W + s·B·A||, computed factored (B·A is never formed). Fine: "
     "positive, of the order of ||W||; rows with n = 0 or where W cancels s·B·A are warnings."),
    ("med |g-1|", "median over features of |g - 1|, g = m/n: how far training moved each feature's scale (0 or rounding-sized "
     "for a fresh adapter)."),
    ("g≠1", f"features (of d_out) whose |g - 1| is above rounding noise: {NOISE_ULPS} ulps of the precision the stored "
     "magnitudes carry (fp32, or bf16/fp16 when every value is exactly representable there, as PEFT's init leaves them on a "
     "16-bit base) plus the fp32 rounding of the norm, eps32·(2 + log2 d_in)·κ, κ = (||W||² + 2s|<W,BA>| + s²||BA||²)/n²."),
    ("bf16→1, fp16→1", "of those g≠1 features, the share whose g rounds to exactly 1 in bf16 (g-1 within -2^-9..+2^-8) or fp16 "
     "(-2^-12..+2^-11): a compose or merge that rounds g to that dtype loses their learned scale. A fresh adapter shows 0%. "
     "Not a defect of the file (doracheck keeps g in fp32), so never a finding: a high share says the learned magnitudes are "
     "finer than that dtype can hold."),
    ("merge ulp", "median/max error, in ulps of each output in W's dtype (in fp32 ulps for an fp64 W: the merge is computed "
     "in fp32), of the merged weight W' = g·(W + s·B·A) (fp32 merge, one rounding to W's dtype) on 8 random probe inputs. One rounding gives a median near 0.5; the max is large wherever a probe "
     "output cancels to near 0 (its ulp is tiny) and is no defect by itself. Warning when the median exceeds "
     f"{MERGE_MEDIAN_ULP_LIMIT:g} ulp."),
    ("merge/bound", "the largest probe error over its a-priori bound |x|·(u·|g|·(|W| + |s|·|B|·|A|)), u the unit roundoff of "
     "W's dtype plus the fp32 merge's: at most 1 when the merge is as accurate as one rounding allows; above 1 (overflow, "
     "subnormal underflow) is a warning."),
    ("-", "not computed: no --base, no adapter_config.json (scaling unknown), a plain LoRA module, or an earlier error."),
)
STRUCTURE_LEGEND = LEGEND[:3]

MEMORY_LEGEND = ("norm scratch: the extra memory of computing the norms at the largest module, like for like in fp32, W itself "
                 "excluded: a dense norm holds at least V = W + s·B·A (d_out×d_in; PEFT's eager path also holds B·A), the "
                 "factored norm holds U = W·Aᵀ (d_out×r), G = A·Aᵀ (r×r) and four d_out vectors.")


def _cell_pct(m: ModuleReport, key: str) -> str:
    return f"{100 * m.stats[key]:.0f}%" if key in m.stats else "-"


def row(m: ModuleReport) -> tuple[str, ...]:
    n, g, merge = m.stats.get("norm"), m.stats.get("g"), m.stats.get("merge_ulp")
    return (
        m.name,
        str(m.r if m.r is not None else "?"),
        f"{m.d_in}→{m.d_out}" if m.d_in is not None else "?",
        f"{m.scaling:.3g}" if m.scaling is not None else "?",
        str(m.count("error")),
        str(m.count("warning")),
        f"{n['min']:.3g}..{n['max']:.3g}" if n else "-",
        f"{g['median_abs_g_minus_1']:.2e}" if g else "-",
        f"{g['learned']}/{m.d_out}" if g and "learned" in g else "-",
        _cell_pct(m, "collapse_bf16"),
        _cell_pct(m, "collapse_fp16"),
        f"{merge['median']:.2f}/{merge['max']:.{1 if merge['max'] < 100 else 0}f}" if merge else "-",
        f"{merge['max_vs_bound']:.2g}" if merge and "max_vs_bound" in merge else "-",
    )


def columns(report: AuditReport) -> int:
    """How many of HEADER's columns the report has values for (a plain LoRA adapter: structure only)."""
    return STRUCTURE_COLUMNS if report.plain_lora else len(HEADER)


def header(report: AuditReport) -> tuple[str, ...]:
    return HEADER[: columns(report)]


def legend(report: AuditReport) -> tuple[tuple[str, str], ...]:
    if report.plain_lora:
        return STRUCTURE_LEGEND
    return (*LEGEND, ("norm scratch", MEMORY_LEGEND.split(": ", 1)[1]))


def rows(report: AuditReport) -> list[tuple[str, ...]]:
    return [row(m)[: columns(report)] for m in report.modules]


def memory_line(report: AuditReport) -> str | None:
    largest = report.largest_module()
    if largest is None:
        return None
    mem = largest.stats["memory_bytes"]
    dense, factored = mem["dense_norm"], mem["factored_norm"]
    return (f"norm scratch at the largest module ({largest.name}, {largest.d_out}×{largest.d_in}, r = {largest.r}), fp32: "
            f"dense W + s·B·A {format_bytes(dense)}, factored terms {format_bytes(factored)} ({dense / max(factored, 1):.1f}× less)")


def summary_line(report: AuditReport) -> str:
    s = report.summary()
    text = f"summary: {s['modules']} modules, {s['errors']} errors, {s['warnings']} warnings, {s['infos']} info"
    if report.plain_lora:
        text += " (plain LoRA: nothing DoRA-specific audited)"
    return text
