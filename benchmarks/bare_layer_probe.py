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

from doracheck.integrations import peft_train
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


class BareFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, result, x, weight, lora_A, lora_B, magnitude, bias, scaling, backend):
        d_in, d_out = x.shape[-1], result.shape[-1]
        x2 = x.reshape(-1, d_in)
        r2 = result.view(x2.shape[0], d_out)
        with our_numerics(x.device.type):
            key = id(lora_A)
            if torch._C._current_graph_task_id() != -1 and key in _NORMS:  # the recompute inside the backward
                n, g = _NORMS[key]
            else:
                fn, _n_safe, g = backend.scaled_norm(weight, lora_A, lora_B, magnitude, scaling, False)
                n = fn.norm
                _NORMS[key] = (n, g)
            xa = F.linear(x2, lora_A)
            y, _h, _ = backend.compose_saving(r2, xa, lora_B, g, bias, scaling, True, True)
            if y is not r2:
                r2.copy_(y)
        ctx.mark_dirty(result)
        ctx.save_for_backward(x2, xa, result, g, n)
        ctx.params = (weight, lora_A, lora_B, magnitude)
        ctx.scaling, ctx.backend, ctx.xshape = scaling, backend, x.shape
        return result

    @staticmethod
    def backward(ctx, dy):
        x2, xa, y, g, n = ctx.saved_tensors
        W, A, B, m = ctx.params
        s = ctx.scaling
        T, d_out = x2.shape[0], g.shape[0]
        dy2 = dy.reshape(T, d_out)
        with our_numerics(dy.device.type):
            dz, dm = ctx.backend.grad_scale_dm(dy2, y.view(T, d_out), g, n, None, True, True, True)
            dzB = dz @ B
            dx = dz @ W
            dx.addmm_(dzB, A, alpha=s)
            dB = torch.addmm(_zero(dz), dz.t(), xa, beta=0, alpha=s)
            dA = torch.addmm(_zero(dz), dzB.t(), x2, beta=0, alpha=s)
        return None, dx.view(ctx.xshape), None, dA, dB, dm.to(m.dtype), None, None, None


def install(on: bool) -> None:
    """Swap ``BareFunction`` into the training plans (on) or put the library's Function back."""
    peft_train.PlannedFromBaseFunction = BareFunction if on else _ORIGINAL  # type: ignore[misc]


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
    for on in (False, False, True):  # the library twice (the plans start on the second call), then the bare one
        install(on)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
    install(False)
    worst = max(float((grads[2][k] - grads[1][k]).norm() / grads[1][k].norm().clamp_min(1e-30)) for k in grads[1])
    print(f"bare vs library: {len(grads[1])} gradients, worst relative L2 difference {worst:.3g}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(_check())
