"""Host µs of one layer's decode call (T = 1, no grad), PEFT LoRA against doracheck, and of each
piece of doracheck's call (diagnostic).

Eager decode is host-bound (issue 17: 0.655x PEFT LoRA's tokens/s on the H200 while the
kernels take about as long as LoRA's). This times, without synchronising inside the timed
loop, one PEFT ``Linear`` called on one token: plain LoRA, PEFT's DoRA, doracheck with its norm
buffer armed (as it runs inside ``generate``), then the pieces of doracheck's call down to the
kernel launches, and ends with a cProfile of the armed call by own time. Figures move ±30%
between the lent hosts: read shares, and compare rows of one run only.

    python benchmarks/decode_layer_host.py [--d 4096 --r 384] [--out FILE]
"""

from __future__ import annotations

import argparse

import peft
import torch
import torch.nn.functional as F
from host_breakdown import cprofile_text, host_us
from row_csv import print_report
from torch import nn

from doracheck import dispatch, inference_norms, numerics
from doracheck import forward as forward_pass
from doracheck.autograd import dora_from_base
from doracheck.integrations import peft as dc_peft
from doracheck.kernels import ops
from doracheck.kernels.compose_triton import lora_up_compose_triton
from doracheck.layer_state import LayerArgs
from doracheck.validation import check_dora_inputs


class _One(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(x)


def _peft_layer(d: int, r: int, use_dora: bool, device):
    torch.manual_seed(0)
    model = peft.get_peft_model(_One(d).to(device, torch.bfloat16),
                                peft.LoraConfig(r=r, lora_alpha=2 * r, use_dora=use_dora, target_modules=["proj"]))
    model = model.to(device, torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # off PEFT's zero init: never time on zeros
    return model, model.base_model.model.proj


def _direct_launch_cases(launch):
    """What Triton's launch costs without its binder: the compose's arguments, captured from one
    ``launch``, bound once, then the compiled kernel's launcher called directly (the floor of any
    launch path that skips Triton's per-call specialization), and the binder alone."""
    from doracheck.kernels import compose_triton, fast_launch

    fast_launch.clear()  # so that the launch below goes through Triton's run, where it is captured
    kernel = compose_triton._lora_up_compose_kernel
    captured: dict = {}
    real_run = kernel.run

    def capture(*a, grid, warmup, **kw):
        captured.update(args=a, kwargs=kw, grid=grid)
        return real_run(*a, grid=grid, warmup=warmup, **kw)

    kernel.run = capture
    try:
        launch()
    finally:
        del kernel.run
    a, kw, grid = captured["args"], captured["kwargs"], captured["grid"]
    compiled = real_run(*a, grid=grid, warmup=False, **kw)
    binder = kernel.device_caches[torch.cuda.current_device()][4]
    values = tuple(binder(*a, **kw)[0].values())
    stream = torch.cuda.current_stream().cuda_stream
    g0 = grid[0]

    def direct():
        compiled.run(g0, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    return [("      direct CompiledKernel.run (args bound)", direct), ("      triton binder alone", lambda: binder(*a, **kw)),
            ("      current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0))]


def _plan_cases(dc, x, result, A, B, m, n_safe):
    """The armed layer's plan (doracheck/integrations/peft_armed.py) and its two launches, where
    the library measured has one (an earlier library, run from .old/, has not)."""
    try:
        from doracheck.integrations import peft_armed
    except ImportError:
        return []
    dc(x)  # the first armed call keeps the plan
    plan = dc.__dict__[peft_armed._PLANS]["default"]

    def xa_flags_off():
        numerics._flags_enter()
        try:
            return F.linear(x, A)
        finally:
            numerics._flags_exit()

    xa = xa_flags_off()
    return [
        ("  peft_armed.armed_forward (after the base linear)", lambda: peft_armed.armed_forward(dc, "default", x, result, {})),
        ("    F.linear(x, A), flags off", xa_flags_off),
        ("    InferCompose (direct launch)", lambda: plan.compose(result, xa, 1, B, m, None, n_safe) if plan.compose else None),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--r", type=int, default=384)
    ap.add_argument("--n", type=int, default=200, help="calls per timed batch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    _, lora = _peft_layer(args.d, args.r, False, dev)
    _, peft_dora = _peft_layer(args.d, args.r, True, dev)
    dc_model, dc = _peft_layer(args.d, args.r, True, dev)
    dc_peft.enable(dc_model)
    holder = dc_model.__dict__[inference_norms._HOLDER]
    x = torch.randn(1, 1, args.d, device=dev, dtype=torch.bfloat16)
    W = dc.base_layer.weight
    A, B, m = dc.lora_A["default"].weight, dc.lora_B["default"].weight, dc.lora_magnitude_vector["default"].weight
    s = float(dc.scaling["default"])
    rows = []
    with torch.no_grad():
        inference_norms._prepare(dc_model, holder)  # armed, as inside generate
        assert inference_norms.norm_buffer(dc, "default") is not None
        n_safe = inference_norms.norm_buffer(dc, "default")
        result = F.linear(x, W)
        x2, r2 = x.view(1, -1), result.view(1, -1)
        xa = x2 @ A.t()
        backend = dispatch.backend_for(x, W, A, B, m)
        a = LayerArgs(W, A, B, m, None, s, False, 0.0, True)
        variant = dc.lora_variant["default"]

        def numerics_only():
            with numerics.our_numerics("cuda"):
                pass

        cases = [
            ("F.linear(x, W), one token", lambda: F.linear(x, W)),
            ("PEFT LoRA layer", lambda: lora(x)),
            ("PEFT DoRA layer", lambda: peft_dora(x)),
            ("doracheck layer, armed", lambda: dc(x)),
            ("  variant.forward (after the base linear)", lambda: variant.forward(dc, "default", x, result)),
            ("  _submodules", lambda: dc_peft._submodules(dc, "default")),
            ("  check_dora_inputs", lambda: check_dora_inputs(x, W, A, B, m, s, None, dropout_p=0.0, fan_in_fan_out=False)),
            ("  norm_buffer", lambda: inference_norms.norm_buffer(dc, "default")),
            ("  dora_from_base", lambda: dora_from_base(x, result, W, A, B, m, None, s, False, None, 0.0, True, n_safe)),
            ("    our_numerics enter + exit", numerics_only),
            ("    dispatch.backend_for", lambda: dispatch.backend_for(x, result, W, A, B, m)),
            ("    from_base_forward", lambda: forward_pass.from_base_forward(result, x, a, None, backend, need_saved=False,
                                                                            n_safe=n_safe)),
            ("      x2 @ A.t()", lambda: x2 @ A.t()),
            ("      ops.compose_infer_", lambda: ops.compose_infer_(r2, xa, B, m, n_safe, None, s, True)),
            ("      lora_up_compose_triton (launch, fast_launch)", lambda: lora_up_compose_triton(r2, xa, B, m, s, None, out=r2,
                                                                                      base_has_bias=True, n_safe=n_safe)),
        ]
        cases += _plan_cases(dc, x, result, A, B, m, n_safe)
        if dev.type == "cuda":
            cases += _direct_launch_cases(lambda: lora_up_compose_triton(r2, xa, B, m, s, None, out=r2, base_has_bias=True,
                                                                          n_safe=n_safe))
        for name, fn in cases:
            rows.append((name, host_us(fn, args.n, sync)))
        profile = cprofile_text(lambda: dc(x), 2000, sync, "tottime", 30)
        inference_norms._finish(holder)
    import triton

    head = (f"# decode_layer_host.py, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch "
            f"{torch.__version__}, triton {triton.__version__}, peft {peft.__version__}; d {args.d}, r {args.r}, T 1, bf16, "
            f"no grad; host µs per call, median of 5 batches of {args.n}")
    lines = [head, *(f"{name:<48}{us:8.1f}" for name, us in rows), "== cProfile of 2000 armed doracheck layer calls, by own time",
             profile]
    print_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
