"""Which op makes a whole doracheck layer (forward + backward) differ bitwise between two runs?

Runs the case of tests/test_kernels_gpu.py::test_bitwise_deterministic three times under
torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8, recording the
output of every op doracheck issues (its Triton ops, and every aten GEMM through a dispatch
mode), then names the first op whose output differs between runs, on the Triton path and on
the torch path (cuBLAS only). Usage (GPU): python benchmarks/determinism_probe.py
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import doracheck  # noqa: E402
from doracheck.dispatch import use_path  # noqa: E402
from doracheck.norm_cache import clear_norm_cache  # noqa: E402
from doracheck.properties import make_case  # noqa: E402


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "empty" in str(func):  # uninitialised until a Triton kernel writes it (seen by the ops that read it)
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                self.log.append((str(func), o.detach().clone()))
        return out


def one_run(case, dy):
    clear_norm_cache()
    tensors = (case.x, case.lora_A, case.lora_B, case.magnitude, case.bias)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    rec = Recorder()
    with rec:
        y = doracheck.dora_linear(leaves[0], case.weight, leaves[1], leaves[2], leaves[3], case.scaling, leaves[4])
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
    torch.cuda.synchronize()
    return y.detach(), grads, rec.log


def main() -> int:
    torch.use_deterministic_algorithms(True)
    case = make_case(4096, 4096, 128, 1024, torch.bfloat16, seed=3, device="cuda")
    dy = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))
    for path in ("triton", "torch"):
        with use_path(path):
            runs = [one_run(case, dy) for _ in range(3)]
        same_out = all(torch.equal(runs[0][0], r[0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], r[1])) for r in runs[1:])
        print(f"[{path}] outputs bitwise equal over 3 runs: {same_out}; ops recorded: {len(runs[0][2])}")
        for i in (1, 2):
            log0, logi = runs[0][2], runs[i][2]
            if len(log0) != len(logi):
                print(f"  run {i}: {len(logi)} ops against {len(log0)}")
            for k, ((f0, t0), (fi, ti)) in enumerate(zip(log0, logi)):
                if f0 != fi or t0.shape != ti.shape or not torch.equal(t0, ti):
                    diff = (t0.double() - ti.double()).abs().max().item() if t0.shape == ti.shape else float("nan")
                    print(f"  run {i}: first differing op #{k}: {f0} -> {fi}, shape {tuple(t0.shape)}, max |diff| {diff:.3e}")
                    break
            else:
                print(f"  run {i}: every recorded op bitwise equal to run 0")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
