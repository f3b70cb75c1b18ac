"""Layer benchmark: one DoRA linear layer, side by side in one process (run it on the GPU).

Implementations (bf16 activations, frozen bf16 base weight, no bias, dropout 0):
  linear          plain nn.Linear with a frozen weight (the floor reference)
  peft_dora_fp32  PEFT DoRA, its default fp32 adapters (autocast_adapter_dtype=True)
  peft_dora_bf16  PEFT DoRA, bf16 adapters (autocast_adapter_dtype=False)
  doracheck_bf16  doracheck.DoRALinear, bf16 adapters
  doracheck_fp32  doracheck.DoRALinear, fp32 adapters (PEFT's default dtype)
Modes: ``infer`` (eval, no_grad forward; doracheck reuses its norm cache across calls, PEFT's
DoRA cache is off by default), ``train`` (forward + backward, x requires grad, adapter
grads reset to None between repetitions by do_bench; no optimizer, so doracheck's norm stays
cached: labelled as such) and ``step`` (forward + backward + fused AdamW ``optimizer.step()``
on the trainable parameters + ``zero_grad``, so every call recomputes the norm, as training
does; for the frozen ``nn.Linear`` there is nothing to update and its row is forward + backward,
the reference issue 17's layer target divides by). Times: triton.testing.do_bench
(CUDA events, L2 flushed between repetitions), median and 20/80% quantiles. Peak memory:
``max_memory_allocated`` during one call minus what was allocated before it (resident:
weights, adapters, x, dy). Random, non-zero data everywhere (B is not left at zero).

Usage: python benchmarks/bench_layer.py [--csv FILE] [--shapes 4096x4096r16,...] [--tokens 1,4096] [--modes infer,train,step]
Prints a table last; writes the CSV (GPU name, versions, shape, mode, median, quantiles, MiB).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
import triton
from row_csv import RowWriter
from torch import nn

import doracheck

DEFAULT_SHAPES = "4096x4096r16,4096x4096r128,8192x8192r384,4096x14336r384,14336x4096r384"


def parse_shapes(text: str):
    out = []
    for item in text.split(","):
        dims, r = item.split("r")
        d_in, d_out = dims.split("x")
        out.append((int(d_in), int(d_out), int(r)))
    return out


class _Holder(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


def _randomise_adapter(lora_A: torch.Tensor, lora_B: torch.Tensor, gen: torch.Generator):
    with torch.no_grad():
        lora_A.copy_(torch.randn(lora_A.shape, generator=gen, device="cpu").mul_(lora_A.shape[1] ** -0.5))
        lora_B.copy_(torch.randn(lora_B.shape, generator=gen, device="cpu").mul_(0.02))


def build(impl: str, d_in: int, d_out: int, r: int, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(d_out, d_in, generator=gen) * d_in**-0.5)
    linear = linear.to(device="cuda", dtype=torch.bfloat16)
    linear.weight.requires_grad_(False)
    if impl == "linear":
        return linear
    if impl.startswith("peft"):
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, target_modules=["proj"], lora_dropout=0.0)
        model = get_peft_model(_Holder(linear), cfg, autocast_adapter_dtype=(impl == "peft_dora_fp32"))
        layer = model.base_model.model.proj
        _randomise_adapter(layer.lora_A["default"].weight, layer.lora_B["default"].weight, gen)
        with torch.no_grad():
            mag = layer.lora_magnitude_vector["default"].weight
            mag.mul_(1 + 0.01 * torch.randn(mag.shape, generator=gen).to(mag.device, mag.dtype))
        return model
    adapter_dtype = torch.bfloat16 if impl == "doracheck_bf16" else torch.float32
    layer = doracheck.DoRALinear.from_linear(linear, r=r, lora_alpha=2 * r)
    layer.lora_A.data = layer.lora_A.data.to(adapter_dtype)
    layer.lora_B.data = layer.lora_B.data.to(adapter_dtype)
    layer.magnitude.data = layer.magnitude.data.to(adapter_dtype)
    _randomise_adapter(layer.lora_A, layer.lora_B, gen)
    with torch.no_grad():
        layer.magnitude.mul_(1 + 0.01 * torch.randn(d_out, generator=gen).to("cuda", adapter_dtype))
    return layer


def trainable(model: nn.Module):
    return [p for p in model.parameters() if p.requires_grad]


def measure(model: nn.Module, mode: str, x: torch.Tensor, dy: torch.Tensor):
    params = trainable(model)
    if mode == "infer":
        model.eval()

        def fn():
            with torch.no_grad():
                return model(x)

        grad_to_none = None
    elif mode == "train":
        model.train()
        xg = x.detach().requires_grad_(True)

        def fn():
            model(xg).backward(dy)

        grad_to_none = [xg, *params]
    else:  # step: the update in the call, so no norm survives from one call to the next
        model.train()
        xg = x.detach().requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True) if params else None

        def fn():
            model(xg).backward(dy)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

        grad_to_none = [xg]
    fn()  # warm-up (compilation, norm cache)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
    for p in grad_to_none or []:
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    del out
    for p in grad_to_none or []:
        p.grad = None
    return ms, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--impls", default="linear,peft_dora_fp32,peft_dora_bf16,doracheck_bf16,doracheck_fp32")
    ap.add_argument("--modes", default="infer,train,step", help="infer, train (no optimizer), step (+ fused AdamW)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layer: needs a CUDA device", file=sys.stderr)
        return 2
    import peft

    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    versions = {"torch": torch.__version__, "triton": triton.__version__, "peft": peft.__version__, "doracheck": doracheck.__version__}
    out = RowWriter(args.csv)
    impls = args.impls.split(",")
    for d_in, d_out, r in parse_shapes(args.shapes):
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16)
            results = {}
            for impl in impls:
                model = build(impl, d_in, d_out, r)
                for mode in args.modes.split(","):
                    (med, q20, q80), peak = measure(model, mode, x, dy)
                    results[(impl, mode)] = (med, q20, q80, peak)
                del model
                gc.collect()
                torch.cuda.empty_cache()
            for (impl, mode), (med, q20, q80, peak) in results.items():
                lin = results.get(("linear", mode), (float("nan"),))[0]
                pf = results.get(("peft_dora_fp32", mode), (float("nan"),))[0]
                pb = results.get(("peft_dora_bf16", mode), (float("nan"),))[0]
                out.add(
                    {
                        "gpu": gpu, **versions, "impl": impl, "d_in": d_in, "d_out": d_out, "r": r, "tokens": T,
                        "dtype": "bf16", "mode": mode, "median_ms": round(med, 5), "q20_ms": round(q20, 5),
                        "q80_ms": round(q80, 5), "peak_mib": round(peak, 1), "x_linear": round(med / lin, 3),
                        "peft_fp32_over": round(pf / med, 3), "peft_bf16_over": round(pb / med, 3),
                    }
                )
                print(f"{d_in}x{d_out} r{r} T{T} {mode:5s} {impl:15s} {med:8.4f} ms  [{q20:.4f}, {q80:.4f}]  "
                      f"{peak:8.1f} MiB  x{med / lin:5.2f} linear  PEFTfp32/this {pf / med:5.2f}  PEFTbf16/this {pb / med:5.2f}",
                      flush=True)
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
