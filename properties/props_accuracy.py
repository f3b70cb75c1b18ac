"""The accuracy properties: gradients, distance to the fp64 oracle, and the baseline ratio.

 4 gradients             gradcheck in fp64 (both norm modes); forward and backward vs the fp64 oracle
                         within ``a_priori_bound`` (rel_l2 × the output's condition ρ + the norm's κ)
 6 baseline_ratio        err(impl) <= k·err(naive same precision) + floor (``baseline_ratio``)

A zero row where the implementation returns NaN (PEFT) is left to ``edge.zero_row`` (``_zero_row_nan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from doracheck.reference import dora_forward_ref, norm_terms_ref, output_conditions, peft_style_dora, rel_l2

from .budgets import budget_for, u
from .diagnosis import explaining, rel_distance, verdict
from .problems import Problem, make_problem
from .props_common import (
    Implementation,
    _dtype_name,
    _field,
    _grads,
    _na,
    _result,
    _worse,
    configuration,
    mixed,
    rejects_configuration,
)
from .results import CheckResult
from .unsupported import Unsupported


# 4 ---------------------------------------------------------------------------------------
def conditioning(p: Problem) -> float:
    """κ = max_i (||W_i||² + 2|s|·Σ_j |B_ij|·(|W||A|ᵀ)_ij + s²·||(|B||A|)_i||²) / n_i², in fp64: the
    condition of n² as the factored norm forms it (1 when nothing cancels; rows with n = 0 are
    skipped: their output is 0 whatever g is). The absolute-value products bound what rounding can
    do to each factored term: the cross term Σ_j B_ij·(W·Aᵀ)_ij and the lora term Σ_jk B_ij·(A·Aᵀ)_jk·B_ik
    lose digits where W cancels s·B·A and where B·A itself cancels (|B||A| >> |B·A|, as when
    r > d_in; a 1×1, r = 15 lora term was 6.8e-4 off in fp32)."""
    W = (p.weight.t() if p.fan_in_fan_out else p.weight).detach().cpu().double()
    A, B = p.lora_A.detach().cpu().double(), p.lora_B.detach().cpu().double()
    s = float(p.scaling)
    base = (W * W).sum(1)
    cross_abs = (B.abs() * (W.abs() @ A.abs().t())).sum(1)
    lora_abs = ((B.abs() @ A.abs()) ** 2).sum(1)
    total = base + 2 * abs(s) * cross_abs + s * s * lora_abs
    n2 = ((W + s * (B @ A)) ** 2).sum(1)
    ok = n2 > 0
    return float((total[ok] / n2[ok]).max()) if bool(ok.any()) else 1.0


def a_priori_bound(budget, rho: float, kappa: float) -> float:
    """An oracle-distance row made concrete for one case: rel_l2 (roundings × u) times the output's
    condition ρ (``reference.output_conditions``), plus the norm's conditioning term."""
    return _field(budget, "rel_l2") * rho + (budget.cond_k or 0.0) * u("fp32") * kappa


GRADCHECK_RTOL = 1e-6


def gradcheck_fp64(impl: Implementation, family: str) -> list[CheckResult]:
    """torch.autograd.gradcheck in fp64 for x, A, B, m, b (detach_norm False) and x, m, b (True: the
    norm is a constant, so A and B are checked against the oracle's autograd in ``backward_vs_oracle``)."""
    results = []
    p = make_problem(5, 7, 3, (2, 3), torch.float64, seed=3)
    assert p.bias is not None
    bias = p.bias
    for detach in (True, False):
        prop = f"grad.gradcheck_detach_{str(detach).lower()}"
        W = p.weight.detach()
        A0, B0 = p.lora_A.detach(), p.lora_B.detach()
        f: Callable[..., torch.Tensor]
        if detach:  # the norm is a constant: A and B are judged against the oracle instead

            def f_detached(x, m, b, W=W, A0=A0, B0=B0):
                return impl.dora_linear(x, W, A0, B0, m, p.scaling, b, detach_norm=True)

            f = f_detached
            names = ["x", "magnitude", "bias"]
            leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.magnitude, bias)]
        else:

            def f_exact(x, A, B, m, b, W=W):
                return impl.dora_linear(x, W, A, B, m, p.scaling, b, detach_norm=False)

            f = f_exact
            names = ["x", "lora_A", "lora_B", "magnitude", "bias"]
            leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.lora_A, p.lora_B, p.magnitude, bias)]
        try:
            ok = torch.autograd.gradcheck(f, tuple(leaves), raise_exception=False, eps=1e-6, atol=1e-8, rtol=GRADCHECK_RTOL)
        except Unsupported as exc:
            results.append(_na(prop, "fp64", str(exc)))
            continue
        detail, worst = "gradcheck eps 1e-6, atol 1e-8, rtol 1e-6", 0.0
        if not ok:
            worst, where = worst_gradient_entry(f, leaves, names)
            detail = f"{detail}: {where}"
        results.append(CheckResult(prop, "fp64", bool(ok), worst, GRADCHECK_RTOL, 1, detail))
    return results


def worst_gradient_entry(f: Callable[..., torch.Tensor], leaves: list[torch.Tensor], names: list[str],
                         eps: float = 1e-6) -> tuple[float, str]:
    """Where a failed gradcheck fails: per input, the analytic Jacobian (autograd) against central
    differences of ``f``; (the largest error relative to that input's largest numerical entry, a
    line naming the input, the element, both values and that error)."""
    inputs = tuple(t.detach().clone() for t in leaves)
    worst: tuple[float, str] | None = None
    for i, (name, t) in enumerate(zip(names, inputs)):

        def of_one(v, i=i):
            return f(*inputs[:i], v, *inputs[i + 1:])

        try:
            analytic = torch.autograd.functional.jacobian(of_one, t).reshape(-1, t.numel())
        except Exception as exc:  # noqa: BLE001  (a backward that raises is the finding)
            return math.inf, f"the gradient of {name} raised {type(exc).__name__}: {str(exc)[:120]}"
        numerical = torch.empty_like(analytic)
        flat = t.detach().reshape(-1)
        with torch.no_grad():
            for j in range(flat.numel()):
                step = torch.zeros_like(flat)
                step[j] = eps
                plus, minus = of_one((flat + step).reshape(t.shape)), of_one((flat - step).reshape(t.shape))
                numerical[:, j] = ((plus - minus) / (2 * eps)).reshape(-1)
        error = (analytic - numerical).abs()
        scale = max(float(numerical.abs().max()), 1e-12)
        index = int(torch.nan_to_num(error, nan=float("inf")).argmax())
        out, j = divmod(index, t.numel())
        rel = float(error.reshape(-1)[index]) / scale
        if worst is None or not rel <= worst[0]:  # NaN counts as worst
            element = tuple(int(k) for k in torch.unravel_index(torch.tensor(j), t.shape))
            worst = (rel, f"worst d{name}{list(element)} (output {out}): analytic {float(analytic.reshape(-1)[index]):.6g} "
                           f"vs numerical {float(numerical.reshape(-1)[index]):.6g}, error {rel:.3g} of the largest entry")
    return worst if worst is not None else (math.inf, "no inputs")


DROPOUT_P = 0.1
MASK_SEED = 77  # the dropout case's keep-mask: torch.rand(x.shape, seed MASK_SEED) > DROPOUT_P


def backward_vs_oracle(impl: Implementation, problems: list[Problem], family: str) -> list[CheckResult]:
    """Forward y and the gradients of x, A, B, m, b against the fp64 oracle (relative L2), on
    every problem and once more on the first in training with LoRA dropout (a supplied keep-mask,
    p = ``DROPOUT_P``: PEFT's semantics, so the dropout path's forward and gradients are judged).
    A failing case carries its cause (``diagnosis``: the known deviation that reproduces it).

    "cancel" problems are left out: where W cancels s·B·A, x·Wᵀ and s·(x·Aᵀ)·Bᵀ cancel too,
    and any implementation that rounds them to a 16-bit dtype (all do) loses digits in
    proportion; those problems are judged by the baseline ratio and the three-term identity."""
    problems = [p for p in problems if p.kind != "cancel"]
    if not problems:
        return []
    dt = _dtype_name(problems[0].x.dtype)
    worst: dict[str, tuple[float, float, str, dict]] = {}  # prop -> (error, budget, label, case); worst = least margin
    left_to_edge: list[str] = []
    raised: list[str] = []
    rejected: list[str] = []  # cases of a configuration the implementation refuses (n/a, with the reason)
    first_error: Exception | None = None
    runs = [(p, {}, f"{p.label} ({configuration(p)})") for p in problems]
    first = problems[0]  # LoRA dropout in training, with a supplied keep-mask (PEFT's semantics)
    keep = torch.rand(first.x.shape, generator=torch.Generator().manual_seed(MASK_SEED)) > DROPOUT_P
    runs.append((first, {"training": True, "dropout_p": DROPOUT_P, "dropout_mask": keep.to(first.x.device)},
                 f"{first.label}, dropout p = {DROPOUT_P}"))
    for i, (p, kw, label) in enumerate(runs):
        kappa = conditioning(p)
        gen = torch.Generator().manual_seed(1000 + i)
        dy = torch.randn(*p.x.shape[:-1], p.weight_rows.shape[0], generator=gen).to(p.x.device, p.x.dtype)
        try:
            y, grads = _grads(impl.dora_linear, p, dy, lambda t: t.detach().clone(), **kw)
        except Unsupported:
            raise
        except Exception as exc:  # noqa: BLE001  (a crash on one case fails the property; the others still run)
            if mixed(p) and rejects_configuration(exc):  # judged in the configurations it supports
                rejected.append(f"{configuration(p)}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            raised.append(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
            first_error = first_error or exc
            continue
        if _zero_row_nan(p, y):
            left_to_edge.append(p.label)
            continue
        y_ref, grads_ref = _grads(dora_forward_ref, p, dy, lambda t: t.detach().double(), **kw)
        errors = {"forward.y": rel_l2(y, y_ref)}
        errors.update({f"backward.{k}": rel_l2(grads[k], grads_ref[k]) for k in grads})
        rho = output_conditions(p.x, p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias, dy, fan_in_fan_out=p.fan_in_fan_out)
        buds = {prop: a_priori_bound(budget_for(*prop.split("."), dt, family), rho[prop.split(".")[1]], kappa) for prop in errors}
        cause = ""
        if any(not err <= buds[prop] for prop, err in errors.items()):  # a failure here: name its cause
            tolerances = {prop.split(".")[1]: bud for prop, bud in buds.items()}
            cause = " — " + verdict(explaining(impl, p, rel_distance(tolerances), dy, **kw))
        for prop, err in errors.items():
            bud = buds[prop]
            if prop not in worst or _worse(err / bud, worst[prop][0] / worst[prop][1]):
                case = {"recipe": p.recipe, "dy_seed": 1000 + i, "dropout_p": kw.get("dropout_p", 0.0)}
                worst[prop] = (err, bud, f"{label} (κ {kappa:.3g}){cause if not err <= bud else ''}", case)
    note = f"; {len(left_to_edge)} problem(s) with zero rows, NaN there: judged by edge.zero_row" if left_to_edge else ""
    if first_error is not None and len(raised) + len(rejected) == len(runs):
        raise first_error  # it never ran: its own traceback says more than a row
    if rejected and len(rejected) == len(runs):
        raise Unsupported(f"every configuration was refused: {rejected[0]}")
    rows = [replace(_result(prop, dt, err, bud, len(runs) - len(left_to_edge), f"worst: {label}{note}"), case=case) for prop, (err, bud, label, case) in worst.items()]
    if raised:
        rows.append(CheckResult("accuracy.raised", dt, False, math.inf, 0.0, len(raised), f"raised on {len(raised)} case(s): {raised[0]}"))
    if rejected:
        rows.append(_na("accuracy.mixed_dtypes", dt, f"{len(rejected)} case(s) refused, judged on the others: {rejected[0]}"))
    return rows


def _zero_row_nan(p: Problem, y: torch.Tensor) -> bool:
    """True when the problem has a zero row of W + s·B·A and every non-finite output lies in those
    rows' features (PEFT's NaN there): that problem is left to ``edge.zero_row``, which reports it
    once, instead of every accuracy row showing an infinite error. Non-finite elsewhere fails as usual."""
    if bool(torch.isfinite(y).all()) or not bool(torch.isfinite(p.x).all()):
        return False
    n = norm_terms_ref(p.weight, p.lora_A, p.lora_B, p.scaling, fan_in_fan_out=p.fan_in_fan_out).norm
    zero = (n == 0).to(y.device)
    if not bool(zero.any()):
        return False
    return bool(torch.isfinite(y[..., ~zero]).all())


# 6 ---------------------------------------------------------------------------------------
# Over fewer elements than this (the effective number carrying the output's norm, (Σc²)²/Σc⁴) the
# baseline ratio's two relative L2 errors are a handful of roundings each, and the naive one can be
# near 0 by luck (measured without this floor: 1x1 and 1x14 problems failed a correct implementation
# 2 times in 600 hypothesis examples, up to 40x over; a 4x9 dynamic_range dA, its norm in a few
# entries, 1.02x over). Such outputs are judged by the oracle distance alone.
RATIO_MIN_ELEMENTS = 16


def effective_count(exact: torch.Tensor) -> float:
    """(Σ c²)² / Σ c⁴: how many elements carry the norm of ``exact`` (its numel when all are equal)."""
    c2 = exact.detach().double().flatten() ** 2
    total4 = float((c2 * c2).sum())
    return float(c2.sum()) ** 2 / total4 if total4 > 0 else 0.0


def _over(res: CheckResult) -> float:
    """worst / budget, to find the least margin (NaN stays NaN; a zero budget: inf unless error 0)."""
    if math.isnan(res.worst) or math.isnan(res.budget):
        return math.nan
    if res.budget > 0:
        return res.worst / res.budget
    return 0.0 if res.worst == 0 else math.inf


def representation_noise(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative L2 error of ``exact`` rounded once to ``dtype`` (the baseline ratio's floor): no
    implementation returning ``dtype`` does better."""
    return rel_l2(exact.to(dtype), exact)


def baseline_ratio(name: str, impl_out: torch.Tensor, naive_out: torch.Tensor, exact: torch.Tensor, k: float, floor: float) -> CheckResult:
    """err(impl) <= k·err(naive) + floor, relative L2 against ``exact``; the diagnostic names both
    errors, k, the floor and the implementation's worst element."""
    err_impl = rel_l2(impl_out, exact)
    err_naive = rel_l2(naive_out, exact)
    if not math.isfinite(err_naive):  # e.g. PEFT-style NaN on a zero row: no baseline to compare with
        return CheckResult(name, "", True, err_impl, math.inf, 1, f"n/a: naive baseline error {err_naive}", status="n/a")
    limit = k * err_naive + floor
    diff = (impl_out.detach().double().cpu() - exact.detach().double().cpu()).abs()
    worst_index = tuple(int(i) for i in torch.unravel_index(torch.argmax(torch.nan_to_num(diff, nan=math.inf)), diff.shape)) if diff.numel() else ()
    detail = f"err(impl) {err_impl:.3e}, err(naive) {err_naive:.3e}, k {k:g}, floor {floor:.2e}, worst element {worst_index}"
    return CheckResult(name, "", bool(err_impl <= limit), err_impl, limit, 1, detail)


def baseline_ratio_checks(impl: Implementation, problems: list[Problem], family: str) -> list[CheckResult]:
    """Forward and every gradient against the PEFT-style eager DoRA in the same dtype."""
    dt = _dtype_name(problems[0].x.dtype)
    worst: dict[str, CheckResult] = {}
    refused = ""
    for i, p in enumerate(problems):
        gen = torch.Generator().manual_seed(2000 + i)
        dy = torch.randn(*p.x.shape[:-1], p.weight_rows.shape[0], generator=gen).to(p.x.device, p.x.dtype)
        try:
            y, grads = _grads(impl.dora_linear, p, dy, lambda t: t.detach().clone())
        except Exception as exc:  # noqa: BLE001
            if mixed(p) and rejects_configuration(exc):  # judged in the configurations it supports
                refused = f"{configuration(p)}: {type(exc).__name__}: {str(exc)[:120]}"
                continue
            raise
        if _zero_row_nan(p, y):  # judged by edge.zero_row (see _zero_row_nan)
            continue
        y_n, grads_n = _grads(peft_style_dora, p, dy, lambda t: t.detach().clone())
        y_r, grads_r = _grads(dora_forward_ref, p, dy, lambda t: t.detach().double())
        pairs = [("ratio_forward", "y", y, y_n, y_r)] + [("ratio_backward", k, grads[k], grads_n[k], grads_r[k]) for k in grads]
        kappa = conditioning(p)
        for op, out, a, b, c in pairs:
            if effective_count(c) < RATIO_MIN_ELEMENTS:
                continue  # a ratio of two errors over a handful of numbers is noise (the oracle check judges it)
            bud = budget_for(op, out, dt, family)
            cond = 0.0 if out == "db" else (bud.cond_k or 0.0) * u("fp32") * kappa  # db = Σ dy does not involve n
            floor = _field(bud, "floor_repr") * representation_noise(c, a.dtype) + cond
            res = baseline_ratio(f"{op.replace('ratio_', 'ratio.')}.{out}", a, b, c, _field(bud, "ratio_k"), floor)
            res.dtype = dt
            res.detail += f"; {p.label} (κ {kappa:.3g})"
            key = res.prop
            if res.status == "n/a":
                worst.setdefault(key, res)
                continue
            current = worst.get(key)
            if current is None or current.status == "n/a" or _worse(_over(res), _over(current)):
                worst[key] = res
    compared = sum(1 for r in worst.values() if r.status != "n/a")
    if not worst:  # nothing compared is no pass: say so (the oracle distance judged these outputs)
        return [CheckResult("ratio", dt, True, 0.0, 0.0, 0, f"n/a: no output has {RATIO_MIN_ELEMENTS} effective elements "
                            "(judged by the oracle distance alone)", status="n/a")]
    for r in worst.values():
        r.cases = len(problems)
        r.detail += f"; {compared} of {len(worst)} outputs compared"
    return list(worst.values()) + ([_na("ratio.mixed_dtypes", dt, f"refused, judged on the others: {refused}")] if refused else [])
