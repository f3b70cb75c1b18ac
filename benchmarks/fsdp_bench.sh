#!/usr/bin/env bash
# FSDP2 on a two-GPU machine (nvidia-h200-x2), fsdp_train.py under torchrun over NCCL:
#   check: a tiny LLaMA-style model, fp32, 50 AdamW steps, against the same training on one GPU;
#   check with the norm cache forced on (--unsafe-keep-norm-cache: the deviation stale norms add);
#   time: step time and memory per GPU, doracheck and PEFT's own DoRA (hidden 2048, intermediate
#   5632, 4 layers, r = 64, sequence 2048, batch 2, bf16 mixed precision, AdamW included);
# then, on GPU 0, the norm of all rows against the norm of one rank's rows (fsdp_norm_shard_cost.py).
# Rank 0's JSON lines are collected in $R/fsdp_h200.jsonl.
# Usage: bash benchmarks/fsdp_bench.sh
set -u
source benchmarks/gpu_common.sh
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_train.py"
MED="--mode time --steps 13 --vocab 32000 --hidden 2048 --intermediate 5632 --layers 4 --heads 16 --kv-heads 4 --rank 64 --seq 2048 --batch 2"
step fsdp_check 90 $TR --mode check --steps 50
step fsdp_unsafe 90 $TR --mode check --steps 50 --unsafe-keep-norm-cache
step fsdp_time_doracheck 90 $TR $MED --impl doracheck
step fsdp_time_peft 90 $TR $MED --impl peft
step shard_cost 60 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/fsdp_norm_shard_cost.py --world 2
for f in fsdp_check fsdp_unsafe fsdp_time_doracheck fsdp_time_peft; do grep -h '^{' "$R/$f.log"; done >"$R/fsdp_h200.jsonl"
for f in fsdp_check fsdp_unsafe fsdp_time_doracheck fsdp_time_peft; do tail -n 3 "$R/$f.log" | cut -c1-300; done
cat "$R/shard_cost.log"
finish
