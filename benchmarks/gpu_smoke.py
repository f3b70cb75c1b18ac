"""Quick end-to-end check on a GPU: every path of dora_linear against the fp64 oracle."""

import torch
from doracheck.reference import dora_forward_ref, norm_terms_ref, rel_l2

import doracheck

torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__)
for d_out, d_in, r, T in ((37, 45, 19, 21), (1024, 768, 64, 300), (4096, 4096, 16, 1)):
    for dt, adt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float32)):
        W = (torch.randn(d_out, d_in, device=dev) / d_in**0.5).to(dt)
        A = (torch.randn(r, d_in, device=dev) / d_in**0.5).to(adt).requires_grad_()
        B = (torch.randn(d_out, r, device=dev) / r**0.5).to(adt).requires_grad_()
        n = norm_terms_ref(W, A, B, 2.0).norm
        m = (n * (1 + 0.01 * torch.randn_like(n))).to(adt).requires_grad_()
        b = torch.randn(d_out, device=dev).to(dt).requires_grad_()
        x = torch.randn(T, d_in, device=dev).to(dt).requires_grad_()
        y = doracheck.dora_linear(x, W, A, B, m, 2.0, b)
        dy = torch.randn_like(y)
        gr = torch.autograd.grad(y, (x, A, B, m, b), dy)
        xs = [t.detach().double().requires_grad_() for t in (x, A, B, m, b)]
        yr = dora_forward_ref(xs[0], W, xs[1], xs[2], xs[3], 2.0, xs[4])
        grr = torch.autograd.grad(yr, xs, dy.double())
        nn_ = doracheck.factored_norm(W, A, B, 2.0)
        print(f"{d_out}x{d_in} r{r} T{T} {dt} A:{adt}: norm {rel_l2(nn_, n):.1e} y {rel_l2(y, yr):.1e} "
              + " ".join(f"{k}{rel_l2(a, c):.1e}" for k, a, c in zip(("dx", "dA", "dB", "dm", "db"), gr, grr)))
