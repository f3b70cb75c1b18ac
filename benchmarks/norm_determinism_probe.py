"""Is the factored norm (and the layer) bitwise repeatable, and is each call within the fp64 oracle? (H200 probe)"""
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch

import doracheck
from doracheck.dispatch import factored_norm_full
from doracheck.norm_cache import clear_norm_cache
from doracheck.properties import make_case
from doracheck.reference import norm_terms_ref, rel_l2

torch.use_deterministic_algorithms(True)
for (d_out, d_in, r, T, dt) in [(4096, 4096, 128, 1024, torch.bfloat16), (4096, 4096, 128, 1024, torch.float32), (1000, 3000, 100, 77, torch.bfloat16)]:
    case = make_case(d_out, d_in, r, T, dt, seed=3, device="cuda")
    ref = norm_terms_ref(case.weight, case.lora_A, case.lora_B, case.scaling).norm
    ns = []
    for _i in range(4):
        fn = factored_norm_full(case.weight, case.lora_A, case.lora_B, case.scaling, fan_in_fan_out=False, need_factors=False)
        torch.cuda.synchronize()
        ns.append(fn.norm.clone())
    print(d_out, d_in, r, dt, "rel err to fp64 per call:", [f"{rel_l2(n, ref):.2e}" for n in ns], "equal to call 0:", [torch.equal(ns[0], n) for n in ns[1:]])
    # the layer, three times: y and grads equal?
    dy = torch.randn(*case.x.shape[:-1], d_out, device="cuda", dtype=dt, generator=torch.Generator("cuda").manual_seed(0))
    outs = []
    for _i in range(3):
        clear_norm_cache()
        leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.lora_A, case.lora_B, case.magnitude)]
        y = doracheck.dora_linear(leaves[0], case.weight, leaves[1], leaves[2], leaves[3], case.scaling, case.bias)
        gs = torch.autograd.grad(y, leaves, dy)
        outs.append((y.detach(), gs))
    print("   layer y equal:", [torch.equal(outs[0][0], o[0]) for o in outs[1:]], "grads equal:", [[torch.equal(a, b) for a, b in zip(outs[0][1], o[1])] for o in outs[1:]])
