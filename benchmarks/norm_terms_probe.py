"""Which term of the factored norm is off at 4096x4096, r = 128, bf16 (H200 probe).

Per call: G = A·Aᵀ (cuBLAS fp32-output GEMM) and the base, cross and lora terms against fp64,
and whether each is bitwise the first call's. Usage (GPU): python benchmarks/norm_terms_probe.py
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

from doracheck.dispatch import factored_norm_full  # noqa: E402
from doracheck.kernels import norm_triton  # noqa: E402
from doracheck.properties import make_case  # noqa: E402
from doracheck.reference import norm_terms_ref, rel_l2  # noqa: E402

for d_out, d_in, r in [(4096, 4096, 128), (4096, 4096, 64), (1024, 4096, 128), (4096, 1024, 128)]:
    case = make_case(d_out, d_in, r, 8, torch.bfloat16, seed=3, device="cuda")
    W, A, B, s = case.weight, case.lora_A, case.lora_B, case.scaling
    ref = norm_terms_ref(W, A, B, s)
    G_ref = A.double() @ A.double().t()
    first = None
    for call in range(3):
        G = norm_triton.gram_triton(A)
        fn = factored_norm_full(W, A, B, s, fan_in_fan_out=False, need_factors=False)
        torch.cuda.synchronize()
        vals = {"G": G.clone(), "base": fn.base.clone(), "cross": fn.cross.clone(), "lora": fn.lora.clone(), "norm": fn.norm.clone()}
        refs = {"G": G_ref, "base": ref.base, "cross": ref.cross, "lora": ref.lora, "norm": ref.norm}
        first = first or vals
        print(d_out, d_in, r, "call", call, " ".join(f"{k} {rel_l2(v, refs[k]):.1e}{'' if torch.equal(v, first[k]) else '*'}" for k, v in vals.items()))
