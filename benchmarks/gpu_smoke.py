"""End-to-end check on a GPU: every kernel path of dora_linear against the fp64 oracle.

``--small`` keeps shapes small for compute-sanitizer (memcheck) runs; it also covers dropout,
fan_in_fan_out, T = 0, T = 1 and the token-chunked backward.
"""

import sys

import torch

import doracheck
from doracheck.kernels import settings
from doracheck.reference import dora_forward_ref, norm_terms_ref, rel_l2

small = "--small" in sys.argv
torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__)
shapes = ((37, 45, 19, 21), (65, 33, 8, 1), (70, 129, 16, 0)) if small else ((37, 45, 19, 21), (1024, 768, 64, 300), (4096, 4096, 16, 1))
if small:
    settings.BACKWARD_CHUNK_BYTES = 37 * 2 * 8  # several chunks even at these sizes
for d_out, d_in, r, T in shapes:
    for dt, adt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32)):
        for fan, p in ((False, 0.0), (True, 0.0), (False, 0.25)) if small else ((False, 0.0),):
            W = (torch.randn(d_out, d_in, device=dev) / d_in**0.5).to(dt)
            Ws = W.t().contiguous() if fan else W
            A = (torch.randn(r, d_in, device=dev) / d_in**0.5).to(adt).requires_grad_()
            B = (torch.randn(d_out, r, device=dev) / r**0.5).to(adt).requires_grad_()
            n = norm_terms_ref(W, A, B, 2.0).norm
            m = (n * (1 + 0.01 * torch.randn_like(n))).to(adt).requires_grad_()
            b = torch.randn(d_out, device=dev).to(dt).requires_grad_()
            x = torch.randn(T, d_in, device=dev).to(dt).requires_grad_()
            mask = (torch.rand(T, d_in, device=dev) > p).to(dt)
            kw = dict(fan_in_fan_out=fan, dropout_p=p, training=p > 0, dropout_mask=mask if p > 0 else None)
            y = doracheck.dora_linear(x, Ws, A, B, m, 2.0, b, **kw)
            dy = torch.randn_like(y)
            gr = torch.autograd.grad(y, (x, A, B, m, b), dy)
            xs = [t.detach().double().requires_grad_() for t in (x, A, B, m, b)]
            yr = dora_forward_ref(xs[0], Ws, xs[1], xs[2], xs[3], 2.0, xs[4], **kw)
            grr = torch.autograd.grad(yr, xs, dy.double())
            nn_ = doracheck.factored_norm(Ws, A, B, 2.0, fan_in_fan_out=fan)
            with torch.no_grad():  # inference: g = m / max(n, eps) formed in the compose kernel
                yi = doracheck.dora_linear(x, Ws, A, B, m, 2.0, b, fan_in_fan_out=fan)
                yi_ref = dora_forward_ref(xs[0], Ws, xs[1], xs[2], xs[3], 2.0, xs[4], fan_in_fan_out=fan)
            torch.cuda.synchronize()
            print(f"{d_out}x{d_in} r{r} T{T} {dt} A:{adt} fan={fan} p={p}: norm {rel_l2(nn_, n):.1e} y {rel_l2(y, yr):.1e} "
                  f"y_infer {rel_l2(yi, yi_ref):.1e} "
                  + " ".join(f"{k}{rel_l2(a, c):.1e}" for k, a, c in zip(("dx", "dA", "dB", "dm", "db"), gr, grr)))
