"""Shared helpers for the kernel tests (interpreter on CPU, real shapes on the GPU).

``check_against_oracle`` runs ``doracheck.dora_linear`` forward and backward on one case and
compares y and every gradient with the fp64 oracle, in relative L2, against the budget rows
of ``doracheck.properties`` for this device's family.
"""

from __future__ import annotations

import json
import os

import torch

import doracheck
from doracheck.properties import budget_for, device_family, make_case
from doracheck.properties.props import a_priori_bound, conditioning
from doracheck.reference import dora_forward_ref, output_conditions, rel_l2

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
GRAD_NAMES = ("dx", "dA", "dB", "dm", "db")


def _grads(y, leaves, dy):
    """Gradients for the leaves that exist (a case without bias has None there, and gets None)."""
    present = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad(y, present, dy))
    return tuple(None if t is None else next(found) for t in leaves)


def run_case(case, dy, *, impl=doracheck.dora_linear, **kwargs):
    tensors = (case.x, case.lora_A, case.lora_B, case.magnitude, case.bias)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    y = impl(leaves[0], case.weight, leaves[1], leaves[2], leaves[3], case.scaling, leaves[4], **kwargs)
    return y.detach(), _grads(y, leaves, dy)


def oracle(case, dy, **kwargs):
    tensors = (case.x, case.lora_A, case.lora_B, case.magnitude, case.bias)
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    y = dora_forward_ref(leaves[0], case.weight, leaves[1], leaves[2], leaves[3], case.scaling, leaves[4], **kwargs)
    return y.detach(), _grads(y, leaves, dy.double())


def check_against_oracle(case, dtype, *, impl=doracheck.dora_linear, **kwargs):
    """Assert y and the gradients of ``impl`` (``dora_linear``'s signature) are within budget;
    returns the errors for reporting."""
    gen = torch.Generator().manual_seed(1234)
    dy = torch.randn(*case.x.shape[:-1], case.weight.shape[0], generator=gen).to(case.x.device, dtype)
    y, grads = run_case(case, dy, impl=impl, **kwargs)
    y_ref, grads_ref = oracle(case, dy, **kwargs)
    family = device_family(case.x.device)
    name = DTYPE_NAMES[dtype]
    errors = {"y": rel_l2(y, y_ref)}
    errors.update({k: rel_l2(a, b) for k, a, b in zip(GRAD_NAMES, grads, grads_ref) if b is not None})
    _record(case.label, family, name, errors)
    assert y.dtype == dtype and y.shape == y_ref.shape
    rho = output_conditions(case.x, case.weight, case.lora_A, case.lora_B, case.magnitude, case.scaling, case.bias, dy,
                            fan_in_fan_out=case.fan_in_fan_out)
    kappa = conditioning(case)
    budget = a_priori_bound(budget_for("forward", "y", name, family), rho["y"], kappa)
    assert errors["y"] <= budget, f"y: rel err {errors['y']:.3e} > budget {budget:.3e} (ρ {rho['y']:.3g}; {case.label}, {family})"
    for k in (k for k in GRAD_NAMES if k in errors):
        b = a_priori_bound(budget_for("backward", k, name, family), rho[k], kappa)
        assert errors[k] <= b, f"{k}: rel err {errors[k]:.3e} > budget {b:.3e} (ρ {rho[k]:.3g}; {case.label}, {family})"
    return errors


def _record(label: str, family: str, dtype: str, errors: dict) -> None:
    """With DORACHECK_RECORD_ERRORS=DIR, append this case's errors to DIR/<xdist worker>.jsonl
    (one file per process, so xdist workers never share one): the measurements behind the
    budget rows of real-shape GPU cases (properties/budgets.py cites them)."""
    folder = os.environ.get("DORACHECK_RECORD_ERRORS")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"case": label, "family": family, "dtype": dtype, "errors": errors}) + "\n")


def inference_is_training_forward(case, monkeypatch):
    """Assert that the inference forward (no autograd: g = m / max(n, eps) formed inside the
    compose kernel) is bitwise the training forward (g divided by torch), through
    ``dora_linear`` and through ``dora_from_base``, and that the inference calls took that path."""
    from doracheck.autograd import dora_from_base
    from doracheck.kernels import ops

    calls = []
    real = ops.compose_infer_
    monkeypatch.setattr(ops, "compose_infer_", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():  # a magnitude far from ||W||, so g is not near 1
        magnitude = case.magnitude * 1.37
    args = (case.weight, case.lora_A, case.lora_B, magnitude, case.scaling, case.bias)
    m_train = magnitude.clone().requires_grad_()
    y_train = doracheck.dora_linear(case.x, *args[:3], m_train, *args[4:])
    with torch.no_grad():
        y_infer = doracheck.dora_linear(case.x, *args)
    base = torch.nn.functional.linear(case.x, case.weight, case.bias)
    r_train = dora_from_base(case.x, base.clone(), case.weight, case.lora_A, case.lora_B, m_train, case.bias, case.scaling)
    with torch.no_grad():
        r_infer = dora_from_base(case.x, base.clone(), case.weight, case.lora_A, case.lora_B, magnitude, case.bias, case.scaling)
    assert y_train.requires_grad and not y_infer.requires_grad and not r_infer.requires_grad
    assert torch.equal(y_train.detach(), y_infer)
    assert torch.equal(r_train.detach(), r_infer)
    assert len(calls) == 2, "the inference calls did not form g in the kernel"


__all__ = ["check_against_oracle", "inference_is_training_forward", "make_case", "oracle", "run_case"]
