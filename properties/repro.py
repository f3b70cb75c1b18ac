"""A standalone Python reproducer for a failed row of ``doracheck verify`` (``--repro``, the reports).
verify's cases come from fixed ``make_problem`` seeds (no hypothesis), so a problem's ``recipe`` is the
case: an accuracy row (``forward.y``, ``backward.*``) is rebuilt exactly (its worst case, dy and the
keep-mask from the suite's seeds, cast as ``props_common._grads`` casts); a forward row that carries its
case (``compose.near_one``, ``edge.zero_row``) is rebuilt and set beside the fp64 oracle; any other row
re-runs its item."""

from .props_accuracy import MASK_SEED
from .results import CheckResult

_ACCURACY = '''\
import torch
from doracheck.properties.implementations import resolve
from doracheck.properties.problems import make_problem
from doracheck.reference import dora_forward_ref, rel_l2

impl = resolve({spec!r})
p = {recipe}.to({device!r})
dy = torch.randn(*p.x.shape[:-1], p.weight_rows.shape[0], generator=torch.Generator().manual_seed({dy_seed})).to(p.x.device, p.x.dtype)
P = {dropout_p}  # > 0: in training with LoRA dropout, the suite's keep-mask
kw = {{"training": True, "dropout_p": P, "dropout_mask": (torch.rand(p.x.shape, generator=torch.Generator().manual_seed({mask_seed})) > P).to(p.x.device)}} if P else {{}}

def outputs(fn, cast):
    inputs = {{"dx": p.x, "dA": p.lora_A, "dB": p.lora_B, "dm": p.magnitude, "db": p.bias}}
    leaves = {{k: cast(t).requires_grad_() for k, t in inputs.items() if t is not None}}
    y = fn(leaves["dx"], p.weight, leaves["dA"], leaves["dB"], leaves["dm"], p.scaling, leaves.get("db"),
           fan_in_fan_out=p.fan_in_fan_out, **kw)
    grads = torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype), allow_unused=True)
    return {{"y": y.detach(), **{{k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(leaves, grads)}}}}

with (impl.setting or torch.enable_grad)():  # the suite runs in the implementation's setting, if any
    got = outputs(impl.dora_linear, lambda t: t.detach().clone())  # the implementation, in the case's dtypes
    want = outputs(dora_forward_ref, lambda t: t.detach().double())  # the fp64 oracle on the same inputs
error = rel_l2(got[{out!r}], want[{out!r}])
print(f"{prop} [{dtype}]: relative L2 error {{error:.3e}}, budget {budget:.3e} (verify's a-priori bound for this case)")
'''

_FORWARD = '''\
import contextlib
from dataclasses import replace

import torch
from doracheck.properties.implementations import resolve
from doracheck.properties.problems import make_problem
from doracheck.properties.props_norm import compose_problem
from doracheck.reference import dora_forward_ref, rel_l2, ulp_of

impl = resolve({spec!r})
p = {recipe}.to({device!r})
{edit}
with torch.no_grad(), (impl.setting or contextlib.nullcontext)():
    y = impl.dora_linear(p.x, p.weight, p.lora_A, p.lora_B, p.magnitude, p.scaling, p.bias, fan_in_fan_out=p.fan_in_fan_out).cpu()
exact = dora_forward_ref(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in p.args()), fan_in_fan_out=p.fan_in_fan_out)
bad, bad_exact = ~torch.isfinite(y), ~torch.isfinite(exact)
both = ~bad & ~bad_exact
ulps = ((y.double() - exact).abs() / ulp_of(exact, y.dtype))[both]
print(f"{prop} [{dtype}]: y has {{int(bad.sum())}} non-finite values (the fp64 oracle {{int(bad_exact.sum())}}); the finite "
      f"ones: relative L2 error {{rel_l2(y[both], exact[both]):.3e}}, largest {{float(ulps.max()) if ulps.numel() else 0.0:.3g}} ulp")
'''

_ITEM = '''\
from doracheck.properties.implementations import resolve
from doracheck.properties.suite import run_item, suite_items

impl = resolve({spec!r})
item = next(i for i in suite_items(impl, {dtypes!r}, {profile!r}, {device!r}) if i.name == {item!r} and i.dtype == {dtype!r})
for r in run_item(item):  # the item alone (all its rows), then the row of {prop}
    if r.prop == {prop!r}:
        print(f"{{r.prop}} [{{r.dtype}}] {{r.status}} {{r.worst:.3e}} (budget {{r.budget:.3e}}): {{r.detail}}")
'''


def snippet(spec: str, r: CheckResult, device: str, profile: str) -> str:
    """Python source that reproduces the failed row ``r`` of ``verify --impl spec`` (run where the
    implementation's module is importable); its first line names the failure."""
    title = f"# doracheck verify --impl {spec}: {r.prop} [{r.dtype}] FAIL {r.worst:.3e} > {r.budget:.3e}\n"
    if r.case is not None and "edit" in r.case:  # a forward row: its case, beside the oracle
        return title + _FORWARD.format(spec=spec, recipe=r.case["recipe"], device=device, edit=r.case["edit"], prop=r.prop, dtype=r.dtype)
    if r.case is not None:  # an accuracy row (forward.y, backward.*): its worst case, rebuilt
        return title + _ACCURACY.format(spec=spec, recipe=r.case["recipe"], device=device, dy_seed=r.case["dy_seed"], mask_seed=MASK_SEED,
                                        dropout_p=r.case["dropout_p"], out=r.prop.split(".")[1], prop=r.prop, dtype=r.dtype, budget=r.budget)
    dtypes = [] if r.dtype == "fp64" else [r.dtype]  # the fp64 gradcheck item comes with every dtype list
    return title + _ITEM.format(spec=spec, dtypes=dtypes, profile=profile, device=device, item=r.item or r.prop, dtype=r.dtype, prop=r.prop)
