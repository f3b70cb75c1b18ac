"""One DoRA layer against nn.Linear, PEFT DoRA and PEFT LoRA of the same shape, in one process.

Implementations (bf16 activations, a frozen bf16 weight without bias, alpha = 2r, dropout 0,
random non-zero adapters; the suffix is the adapter dtype):
  linear                      nn.Linear, frozen weight: the floor reference
  peft_lora_bf16 / _fp32      PEFT LoRA (fp32 is PEFT's default, autocast_adapter_dtype=True)
  peft_dora_bf16 / _fp32      PEFT DoRA
  doracheck_bf16 / _fp32      doracheck.DoRALinear
  dcpeft_bf16 / _fp32         PEFT DoRA after doracheck.integrations.peft.enable (the user's path)
Modes: ``infer`` (eval, no_grad forward; doracheck reuses its norm between calls, as the norm
rule allows while nothing changes; PEFT's own DoRA cache is off by default), ``train`` (forward + backward, x requires grad, grads
dropped after each call) and ``step`` (forward + backward + fused AdamW ``step()`` + ``zero_grad``:
the adapter is updated in place, so every call computes the norm, as training does; nn.Linear has
nothing to update and its row is forward + backward).

Per (shape, T, mode) every implementation is timed in the same rounds (``harness.interleaved``):
CUDA events per call after warm-up, ``--rounds`` x ``--reps`` samples, median and p10/p90.
``ratio`` is the median over nn.Linear's, with its spread over the rounds; ``floor_x`` is the
FLOP floor of that ratio (base GEMM + LoRA GEMMs + norm GEMM over the base GEMM);
``peft_dora_over`` is PEFT DoRA's median (same adapter dtype) over this one.

    python benchmarks/layer.py [--shapes 8192x8192r384,...] [--tokens 1,4096] [--modes infer,train,step]
    python benchmarks/layer.py --smoke
"""

from __future__ import annotations

import argparse

import harness
import torch
from torch import nn

IMPLS = ["linear", "peft_lora_bf16", "peft_lora_fp32", "peft_dora_bf16", "peft_dora_fp32", "doracheck_bf16",
         "doracheck_fp32", "dcpeft_bf16", "dcpeft_fp32"]
DEFAULT_IMPLS = "linear,peft_lora_bf16,peft_dora_bf16,peft_dora_fp32,doracheck_bf16,doracheck_fp32"
DEFAULT_SHAPES = "4096x4096r16,8192x8192r384,4096x14336r384,14336x4096r384"
FIELDS = ["tokens", "mode", "ratio", "ratio_p10", "ratio_p90", "floor_x", "peft_dora_over"]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'4096x4096r16,...' -> [(d_in, d_out, r)]"""
    out = []
    for item in text.split(","):
        dims, r = item.split("r")
        d_in, d_out = dims.split("x")
        out.append((int(d_in), int(d_out), int(r)))
    return out


def flops(d_in: int, d_out: int, r: int, T: int, mode: str, kind: str) -> float:
    """FLOPs of one call of ``kind`` (linear, lora, dora): the base GEMM (and dx in training; W is
    frozen, so no dW); LoRA adds x·Aᵀ and (x·Aᵀ)·Bᵀ (and their four backward GEMMs in training);
    DoRA adds the norm's W·Aᵀ (2·d_out·d_in·r; the rest of the norm is O(r²·(d_in + d_out)))."""
    total = 2 * T * d_in * d_out * (1 if mode == "infer" else 2)
    if kind != "linear":
        total += 2 * T * r * (d_in + d_out) * (1 if mode == "infer" else 3)
    if kind == "dora":
        total += 2 * d_out * d_in * r
    return total


class _Holder(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


def _randomise(lora_A: torch.Tensor, lora_B: torch.Tensor, magnitude: torch.Tensor | None, gen: torch.Generator):
    """Non-zero adapters: A ~ N(0, 1/d_in), B ~ N(0, 0.02²), magnitude scaled by 1 + N(0, 0.01²)."""
    with torch.no_grad():
        lora_A.copy_(torch.randn(lora_A.shape, generator=gen).mul_(lora_A.shape[1] ** -0.5))
        lora_B.copy_(torch.randn(lora_B.shape, generator=gen).mul_(0.02))
        if magnitude is not None:
            magnitude.mul_(1 + 0.01 * torch.randn(magnitude.shape, generator=gen).to(magnitude.device, magnitude.dtype))


def build(impl: str, d_in: int, d_out: int, r: int, device: str, seed: int = 0, enable=None) -> nn.Module:
    """The layer of ``impl`` (see the module docstring); the same base weight for every impl.
    ``enable``: the ``enable`` function for ``dcpeft`` (ab.py passes each commit's); doracheck is
    imported only when an implementation needs it."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(d_out, d_in, generator=gen) * d_in**-0.5)
    linear = linear.to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    if impl == "linear":
        return linear
    kind, adapter_dtype = impl.rsplit("_", 1)
    if kind.startswith(("peft", "dcpeft")):
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=r, lora_alpha=2 * r, use_dora="dora" in kind or kind == "dcpeft", target_modules=["proj"],
                         lora_dropout=0.0)
        model = get_peft_model(_Holder(linear), cfg, autocast_adapter_dtype=adapter_dtype == "fp32")
        layer = model.base_model.model.proj
        mags = getattr(layer, "lora_magnitude_vector", {})
        mag = mags["default"].weight if "default" in mags else None
        _randomise(layer.lora_A["default"].weight, layer.lora_B["default"].weight, mag, gen)
        if kind == "dcpeft":
            if enable is None:
                from doracheck.integrations.peft import enable
            enable(model)
        return model
    import doracheck

    dt = torch.float32 if adapter_dtype == "fp32" else torch.bfloat16
    layer = doracheck.DoRALinear.from_linear(linear, r=r, lora_alpha=2 * r)
    for name in ("lora_A", "lora_B", "magnitude"):
        getattr(layer, name).data = getattr(layer, name).data.to(dt)
    _randomise(layer.lora_A, layer.lora_B, layer.magnitude, gen)
    return layer


def call(model: nn.Module, mode: str, x: torch.Tensor, dy: torch.Tensor):
    """The callable timed for ``mode`` (infer / train / step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "infer":
        model.eval()

        def infer():
            with torch.no_grad():
                model(x)

        return infer
    model.train()
    xg = x.detach().requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=x.is_cuda) if mode == "step" and params else None

    def train():
        model(xg).backward(dy)
        if opt is not None:
            opt.step()
        xg.grad = None
        for p in params:
            p.grad = None

    return train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="DINxDOUTrR, comma-separated")
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"from {', '.join(IMPLS)}")
    ap.add_argument("--modes", default="infer,train,step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8, help="timed calls per implementation and round")
    harness.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.tokens, args.rounds, args.reps = "64x48r8", "1,16", 2, 2
    device = harness.resolve_device(args, "layer")
    impls = args.impls.split(",")
    results = harness.Results("layer", FIELDS, args.csv, args.smoke)
    printed = []
    for d_in, d_out, r in parse_shapes(args.shapes):
        models = {impl: build(impl, d_in, d_out, r, device) for impl in impls}
        for T in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator().manual_seed(T)
            x = torch.randn(T, d_in, generator=gen).to(device, torch.bfloat16)
            dy = torch.randn(T, d_out, generator=gen).to(device, torch.bfloat16)
            for mode in args.modes.split(","):
                fns = {impl: call(m, mode, x, dy) for impl, m in models.items()}
                for fn in fns.values():  # warm-up: compilation, autotuning, first allocations
                    for _ in range(3):
                        fn()
                harness.sync(device)
                samples = harness.interleaved({k: (lambda f=f: harness.time_call(f, device)) for k, f in fns.items()},
                                              rounds=args.rounds, per_round=args.reps)
                summary = harness.summarise(samples, ref="linear" if "linear" in fns else None)
                for impl, s in summary.items():
                    adt = impl.rsplit("_", 1)[-1] if impl != "linear" else "-"
                    peft = summary.get(f"peft_dora_{adt}")
                    kind = "linear" if impl == "linear" else "lora" if "lora" in impl else "dora"
                    row = results.add({
                        "case": mode, "impl": impl, "shape": f"{d_in}x{d_out}r{r}", "tokens": T, "mode": mode,
                        "dtype": adt, "unit": "ms", **s.row(),
                        "floor_x": round(flops(d_in, d_out, r, T, mode, kind) / flops(d_in, d_out, r, T, mode, "linear"), 3),
                        "peft_dora_over": round(peft.stats.median / s.stats.median, 3) if peft else "",
                    })
                    printed.append(row)
                    print(f"{d_in}x{d_out} r{r} T{T} {mode:5s} {impl:15s} {s.stats} ms  x{s.ratio:.2f} linear "
                          f"({s.ratio_p10:.2f}-{s.ratio_p90:.2f}; floor {row['floor_x']})  PEFT DoRA/this {row['peft_dora_over']}",
                          flush=True)
        del models
        harness.free_memory()
    print(harness.table(printed, ["shape", "tokens", "mode", "impl", "median", "p10", "p90", "ratio", "floor_x",
                                  "peft_dora_over"]))
    print(f"rows appended to {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
