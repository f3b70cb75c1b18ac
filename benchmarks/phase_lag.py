"""Which phase of the training step waits for the host, without a profiler (issue 17).

The step (eager, gradient checkpointing, fused AdamW) is split at its three boundaries:
forward | backward | optimizer step + zero_grad. For each phase this prints
- host ms: the time the Python thread spent issuing it (perf_counter);
- elapsed ms: the GPU time from the phase's first event to its last, as the user's loop runs it
  (the device drained after each step, as ab_step.py does);
- GPU-only ms: the same phase with the device held busy (``torch.cuda._sleep``) while the host
  issues it, so the events time the kernels back to back: the phase's GPU work;
- idle ms = elapsed - GPU-only: how long the GPU waited for the host within the phase.
A phase whose idle is near zero is GPU-bound (host time there is hidden); a phase with idle is
host-bound, and each host microsecond cut there shortens the step.

For the GPU-only run, transformers' ``find_packed_sequence_indices`` is replaced by its answer
for these unpacked inputs (None) without its host sync, or the sync would drain the queue the
sleep built up. Everything else runs unchanged.

    python benchmarks/phase_lag.py --impls peft_lora_bf16,doracheck_bf16 [--steps 6] [--csv FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import transformers.masking_utils as masking_utils
from bench_model import build
from llama_model import add_llama_args
from row_csv import RowWriter

from doracheck.integrations import peft_train
from doracheck.timing import quantile

PHASES = ("forward", "backward", "optimizer")


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    torch.cuda.synchronize()
    return 50_000_000 / start.elapsed_time(end)


@contextlib.contextmanager
def without_packed_sync():
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def timed_step(model, opt, ids, hold_cycles: int | None):
    """(host ms, elapsed or GPU-only ms) per phase of one step; ``hold_cycles``: sleep the GPU
    that long before each phase, the phase's first event recorded after the sleep."""
    host, gpu = [], []
    torch.cuda.synchronize()

    def phases():  # one phase per next()
        loss = model(ids, labels=ids).loss
        yield
        loss.backward()
        yield
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield

    run = phases()
    for _ in PHASES:
        if hold_cycles:
            torch.cuda._sleep(hold_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        next(run)
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        gpu.append((start, end))
    torch.cuda.synchronize()
    return host, [s.elapsed_time(e) for s, e in gpu]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(ap)
    ap.add_argument("--impls", default="peft_lora_bf16,doracheck_bf16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hold-ms", type=float, default=80.0, help="GPU sleep before each phase of the GPU-only run")
    ap.add_argument("--csv")
    ap.add_argument("--new-tokens", type=int, default=0)  # read by bench_model.build
    ap.add_argument("--device", default="cuda")  # the same; the probe needs CUDA
    args, _ = ap.parse_known_args(argv)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
    cycles = int(sleep_cycles_per_ms() * args.hold_ms)
    writer = RowWriter(args.csv) if args.csv else None
    print(f"{'impl':26s} {'phase':10s} {'host ms':>8s} {'elapsed':>8s} {'GPU-only':>8s} {'idle':>7s}")
    for impl in args.impls.split(","):
        # "doracheck_bf16:plans=0": the layers' training plans off (doracheck.integrations.peft_train)
        peft_train.ENABLED = not impl.endswith(":plans=0")
        model = build(impl.split(":")[0], args, checkpointing=True)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
        for _ in range(2):
            timed_step(model, opt, ids, None)
        runs: dict[str, list] = {"plain": [], "held": []}
        for _ in range(args.steps):  # alternating, so drift hits both alike
            runs["plain"].append(timed_step(model, opt, ids, None))
            with without_packed_sync():
                runs["held"].append(timed_step(model, opt, ids, cycles))
        total = [0.0, 0.0, 0.0]
        for i, phase in enumerate(PHASES):
            host = quantile(sorted(r[0][i] for r in runs["plain"]), 0.5)
            elapsed = quantile(sorted(r[1][i] for r in runs["plain"]), 0.5)
            gpu_only = quantile(sorted(r[1][i] for r in runs["held"]), 0.5)
            held_host = quantile(sorted(r[0][i] for r in runs["held"]), 0.5)
            total = [total[0] + host, total[1] + elapsed, total[2] + gpu_only]
            print(f"{impl:26s} {phase:10s} {host:8.2f} {elapsed:8.2f} {gpu_only:8.2f} {elapsed - gpu_only:7.2f}"
                  + ("" if held_host < args.hold_ms else f"   (host {held_host:.1f} ms > hold: GPU-only is an upper bound)"))
            if writer:
                writer.add({"impl": impl, "phase": phase, "host_ms": round(host, 3), "elapsed_ms": round(elapsed, 3),
                            "gpu_only_ms": round(gpu_only, 3), "idle_ms": round(elapsed - gpu_only, 3), "steps": args.steps,
                            "seq": args.seq, "rank": args.rank, "layers": args.layers, "gpu": torch.cuda.get_device_name(),
                            "torch": torch.__version__})
        print(f"{impl:26s} {'step':10s} {total[0]:8.2f} {total[1]:8.2f} {total[2]:8.2f} {total[1] - total[2]:7.2f}")
        del model, opt
        torch.cuda.empty_cache()
    if writer:
        writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
