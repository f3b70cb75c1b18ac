"""A lower bound for the eager layer's host time (diagnostic, issue 17): the planned training
call with doracheck's Python layers taken away.

``BareFunction`` has ``autograd.PlannedFromBaseFunction``'s signature and does the same GPU work
in straight-line code: the norm (the backend's ``scaled_norm``: one graph replay, a clone, an
unbind; recomputed in the checkpoint recompute too, no norm cache), x·Aᵀ, the compose in place
(``compose_saving``), and in the backward the dz/dm pass and five GEMMs, with no token chunks, no
Saved record, no version checks, no zero-magnitude rows pass, no planner. It is NOT correct in
general (m = 0 rows, memory, parameters changed between forward and backward); it is a yardstick:
``install()`` swaps it into ``doracheck.integrations.peft_train`` so ``ab_step.py``'s ``bare=1``
config times the step with it beside the library and PEFT LoRA in one process. If even this is
not within 1.10x of LoRA, the Python around the kernels is not what stands between the library
and that target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from doracheck import autograd as dc_autograd
from doracheck import planner
from doracheck.forward import from_base_forward
from doracheck.integrations import peft_train
from doracheck.layer_state import LayerArgs, Saved
from doracheck.numerics import our_numerics

_ORIGINAL = peft_train.PlannedFromBaseFunction
_ZERO: dict = {}
_NORMS: dict = {}


def _zero(like: torch.Tensor) -> torch.Tensor:
    z = _ZERO.get(like.dtype)
    if z is None:
        z = _ZERO[like.dtype] = like.new_zeros(())
        if z.is_cuda:
            torch.cuda.synchronize()
    return z


def _bare_forward(result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend):
    """(x2, xa, h, from_output, g, n, n_safe) after the compose wrote y into ``result``."""
    d_in, d_out = x.shape[-1], result.shape[-1]
    x2 = x.reshape(-1, d_in)
    r2 = result.view(x2.shape[0], d_out)
    with our_numerics(x.device.type):
        key = id(lora_A)
        if torch._C._current_graph_task_id() != -1 and key in _NORMS:  # the recompute inside the backward
            n, n_safe, g = _NORMS[key]
        else:
            fn, n_safe, g = backend.scaled_norm(weight, lora_A, lora_B, magnitude, scaling, False)
            n = fn.norm
            _NORMS[key] = (n, n_safe, g)
        xa = F.linear(x2, lora_A)
        y, h, from_output = backend.compose_saving(r2, xa, lora_B, g, bias, scaling, True, True)
        if y is not r2:
            r2.copy_(y)
    return x2, xa, (result if from_output else h), from_output, g, n, n_safe


def _bare_backward(dy, x2, xa, h, from_output, g, n, B, A, W, m, s, backend, xshape):
    T, d_out = x2.shape[0], g.shape[0]
    dy2 = dy.reshape(T, d_out)
    with our_numerics(dy.device.type):
        dz, dm = backend.grad_scale_dm(dy2, h.view(T, d_out), g, n, None, from_output, True, True)
        dzB = dz @ B
        dx = dz @ W
        dx.addmm_(dzB, A, alpha=s)
        dB = torch.addmm(_zero(dz), dz.t(), xa, beta=0, alpha=s)
        dA = torch.addmm(_zero(dz), dzB.t(), x2, beta=0, alpha=s)
    return None, dx.view(xshape), None, dA, dB, dm.to(m.dtype), None, None, None


class BareFunction(torch.autograd.Function):
    """Bare forward, bare backward."""

    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend):
        x2, xa, h, from_output, g, n, _ = _bare_forward(result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend)
        ctx.mark_dirty(result)
        ctx.save_for_backward(x2, xa, h, g, n)
        ctx.params = (weight, lora_A, lora_B, magnitude)
        ctx.scaling, ctx.backend, ctx.xshape, ctx.from_output = scaling, backend, x.shape, from_output
        return result

    @staticmethod
    def backward(ctx, dy):
        x2, xa, h, g, n = ctx.saved_tensors
        W, A, B, m = ctx.params
        return _bare_backward(dy, x2, xa, h, ctx.from_output, g, n, B, A, W, m, ctx.scaling, ctx.backend, ctx.xshape)


class BareForwardFunction(torch.autograd.Function):
    """Bare forward, then the library's record (``autograd._save``) and backward."""

    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend):
        x2, xa, h, from_output, g, n, n_safe = _bare_forward(result, x, weight, lora_A, lora_B, magnitude, bias, scaling,
                                                             backend)
        ctx.mark_dirty(result)
        saved = Saved(x2, None, xa, h, g, n, n_safe, None, None, backend, from_output, planner.DEFAULT)
        dc_autograd._save(ctx, saved, LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling), x.shape[:-1])
        ctx.result_is_base = True
        return result

    @staticmethod
    def backward(ctx, dy):
        return (*dc_autograd._from_base_grads(ctx, dy), None, None)


class BareBackwardFunction(_ORIGINAL):
    """The library's forward and record, then the bare backward."""

    @staticmethod
    def backward(ctx, dy):
        x2, xa, h, g, n = ctx.saved_tensors
        a, backend, from_output, lead = ctx.planned
        return _bare_backward(dy, x2, xa, h, from_output, g, n, a.lora_B, a.lora_A, a.weight, a.magnitude, a.scaling, backend,
                              (*lead, a.weight.shape[1]))


class GeneralPlannedFunction(torch.autograd.Function):
    """The planned Function as it was before the straight-line call (twentieth session): the
    general ``forward.from_base_forward`` with a ``Saved`` record (``autograd._save``) and the
    general backward (``autograd._from_base_grads``, ``backward.layer_backward``); bitwise the
    same numbers as the library's, for in-process A/B of the host time."""

    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend):
        a = LayerArgs(weight, lora_A, lora_B, magnitude, bias, scaling)
        with our_numerics(result.device.type):
            out, saved = from_base_forward(result, x, a, None, backend, need_saved=True)
        ctx.mark_dirty(result)
        dc_autograd._save(ctx, saved, a, x.shape[:-1])  # the old planned call passed its parameters as held=: the same record
        ctx.result_is_base = True
        return out

    @staticmethod
    def backward(ctx, dy):
        return (*dc_autograd._from_base_grads(ctx, dy), None, None)


_BY_NAME = {"0": _ORIGINAL, "general": GeneralPlannedFunction, "1": BareFunction, "fwd": BareForwardFunction, "bwd": BareBackwardFunction}


def install(which: str | bool) -> None:
    """Swap a Function into the training plans: "1" (or True) both passes bare, "fwd" the bare
    forward with the library's backward, "bwd" the library's forward with the bare backward,
    "general" the planned Function before the straight-line call, "0" (or False) the library's own."""
    which = {True: "1", False: "0"}.get(which, which) if isinstance(which, bool) else which
    peft_train.PlannedFromBaseFunction = _BY_NAME[which]  # type: ignore[misc]


def _check(argv=None) -> int:
    """Both Functions on the same model and batch: the adapter gradients must agree (the bare
    one does the same GPU work; it differs only where it is not correct in general)."""
    import argparse

    from bench_model import build
    from llama_model import add_llama_args

    ap = argparse.ArgumentParser()
    add_llama_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=0)
    args, _ = ap.parse_known_args(argv)
    model = build("doracheck_bf16", args, checkpointing=True)
    model.train()
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    grads = []
    names = ("0", "0", "1", "fwd", "bwd", "general", "0")  # the library twice (the plans start on the second call), then the bare ones
    for on in names:
        install(on)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
    install(False)
    bad = 0
    for i in range(0, len(names)):
        if i == 1:
            continue
        diff = {k: float((grads[i][k] - grads[1][k]).norm() / grads[1][k].norm().clamp_min(1e-30)) for k in grads[1]}
        k = max(diff, key=diff.__getitem__)
        print(f"bare={names[i]}{' (the first call, before the plans)' if i == 0 else ''} vs library: {len(diff)} gradients, worst relative L2 difference {diff[k]:.3g} ({k}), "
              f"median {sorted(diff.values())[len(diff) // 2]:.3g}")
        bad += diff[k] > 2e-2
    print("(attention's backward on the GPU is not deterministic: the last row, the library again, is the run-to-run difference)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(_check())
