"""Per-module figures for the audit's HTML report (matplotlib, drawn from ``ModuleReport.arrays``).

One figure per numerically audited module, three histograms (a 14336-feature layer: a few kB):
1. g - 1 against the zones where bf16 (-2^-9..+2^-8) and fp16 (-2^-12..+2^-11) round g to 1,
   with the noise floor of g;
2. the three norm terms per feature, ||W||², |2s·<W,BA>| and s²·||BA||², on a log axis;
3. the merge error of the probe outputs in ulps, with the median and the warning threshold.
"""

from __future__ import annotations

import numpy as np

from .checks import MERGE_MEDIAN_ULP_LIMIT, ModuleReport

LEGEND_BELOW = {"fontsize": 7, "loc": "upper center", "bbox_to_anchor": (0.5, -0.28), "ncol": 2, "frameon": False}
ZONES = (("bf16", -(2.0**-9), 2.0**-8, "#f4a261"), ("fp16", -(2.0**-12), 2.0**-11, "#2a9d8f"))


def _log_bins(values: np.ndarray, count: int = 40) -> np.ndarray | None:
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return None
    lo, hi = float(positive.min()), float(positive.max())
    if hi <= lo * 1.0001:
        lo, hi = lo / 2, hi * 2
    return np.geomspace(lo, hi, count)


def _g_panel(ax, arrays: dict) -> None:
    dev = arrays["g_minus_1"]
    floor = float(np.median(arrays["noise_floor"]))
    span = max(float(np.abs(dev).max()) if dev.size else 0.0, 2.0**-8, floor) * 1.15
    for name, lo, hi, color in ZONES:
        ax.axvspan(lo, hi, color=color, alpha=0.25, label=f"{name} rounds g to 1")
    ax.axvline(-floor, color="#555", lw=0.8, ls=":")
    ax.axvline(floor, color="#555", lw=0.8, ls=":", label=f"noise floor ±{floor:.1e}")
    ax.hist(dev, bins=np.linspace(-span, span, 61), color="#264653", histtype="stepfilled", alpha=0.85, label="features")
    ax.set_xlim(-span, span)
    ax.set_xlabel("g - 1", parse_math=False)
    ax.set_ylabel("features", parse_math=False)
    ax.set_title("g - 1 against the 16-bit collapse zones", fontsize=9, parse_math=False)
    ax.legend(**LEGEND_BELOW)


def _terms_panel(ax, arrays: dict) -> None:
    series = (("||W||²", arrays["base"]), ("|2s·<W,BA>|", np.abs(arrays["cross_2s"])), ("s²·||BA||²", arrays["lora_s2"]))
    drawn = False
    for label, values in series:
        bins = _log_bins(values)
        zeros = int(np.sum(values == 0))
        suffix = f" ({zeros} zero)" if zeros else ""
        if bins is None:
            ax.plot([], [], label=f"{label}: all zero")
            continue
        ax.hist(values[values > 0], bins=bins, histtype="step", lw=1.4, label=label + suffix)
        drawn = True
    if drawn:
        ax.set_xscale("log")
    ax.set_xlabel("per-feature value (n² is their sum)", parse_math=False)
    ax.set_ylabel("features", parse_math=False)
    ax.set_title("norm terms", fontsize=9, parse_math=False)
    ax.legend(**LEGEND_BELOW)


def _merge_panel(ax, arrays: dict, stats: dict) -> None:
    err = arrays["merge_ulp"]
    bins = _log_bins(err)
    if bins is not None:
        ax.hist(err[err > 0], bins=bins, color="#6d597a", histtype="stepfilled", alpha=0.8, label="probe outputs")
        ax.set_xscale("log")
    ax.axvline(stats["median"], color="#222", lw=1, label=f"median {stats['median']:.2f} ulp")
    ax.axvline(MERGE_MEDIAN_ULP_LIMIT, color="#b00020", lw=1, ls="--", label=f"warning if median > {MERGE_MEDIAN_ULP_LIMIT:g}")
    ax.set_xlabel("merged-weight output error (ulp)", parse_math=False)
    ax.set_ylabel("outputs", parse_math=False)
    ax.set_title(f"merge error (≤ {stats.get('max_vs_bound', float('nan')):.2g}× the rounding bound)", fontsize=9, parse_math=False)
    ax.legend(**LEGEND_BELOW)


def module_figure(plt, module: ModuleReport):
    """The three-panel figure of one module, or None when its numbers were not computed."""
    arrays = module.arrays
    if "g_minus_1" not in arrays:
        return None
    plt.rcParams["svg.fonttype"] = "none"  # text as text: smaller files, selectable labels
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    _g_panel(axes[0], arrays)
    _terms_panel(axes[1], arrays)
    if "merge_ulp" in arrays:
        _merge_panel(axes[2], arrays, module.stats["merge_ulp"])
    else:
        axes[2].set_axis_off()
    fig.suptitle(module.name, fontsize=10, parse_math=False)  # a user's name: "$" is no math
    fig.tight_layout()
    return fig
