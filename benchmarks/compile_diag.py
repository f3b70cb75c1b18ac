"""Which Triton op, if any, torch.compile (Inductor) computes differently from eager (GPU).

Each registered op (torch.ops.doracheck.*) is compiled alone with fullgraph=True and compared
with its eager result, output by output (rel_l2; 0 means bitwise equal). Diagnostic only.
"""

import torch

import doracheck.kernels.ops  # noqa: F401  (registers the ops)
from doracheck.reference import rel_l2

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
d_out, d_in, r, T = 1024, 768, 64, 256
W = (torch.randn(d_out, d_in, device=dev) / d_in**0.5).to(dt)
A = (torch.randn(r, d_in, device=dev) / d_in**0.5).to(dt)
B = (torch.randn(d_out, r, device=dev) / r**0.5).to(dt)
base = torch.randn(T, d_out, device=dev, dtype=dt)
xa = torch.randn(T, r, device=dev, dtype=dt)
g = 1 + 0.1 * torch.randn(d_out, device=dev)
n = 1 + torch.rand(d_out, device=dev)
bias = torch.randn(d_out, device=dev, dtype=dt)
dy = torch.randn(T, d_out, device=dev, dtype=dt)
ops = torch.ops.doracheck
cases = {
    "factored_norm": (lambda W, A, B: ops.factored_norm(W, A, B, 2.0, False), (W, A, B)),
    "lora_up_compose": (lambda b, xa, B, g: ops.lora_up_compose(b, xa, B, g, None, 2.0), (base, xa, B, g)),
    "lora_up_compose_save_z": (lambda b, xa, B, g, bias: ops.lora_up_compose_save_z(b, xa, B, g, bias, 2.0, False), (base, xa, B, g, bias)),
    "grad_scale_dm": (lambda dy, h, g, n: ops.grad_scale_dm(dy, h, g, n, None, True, True), (dy, base, g, n)),
}
for name, (fn, args) in cases.items():
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    compiled = compiled if isinstance(compiled, (tuple, list)) else (compiled,)
    print(name, " ".join(f"out{i}: rel_l2 {rel_l2(c, e):.3e}" for i, (c, e) in enumerate(zip(compiled, eager))), flush=True)
