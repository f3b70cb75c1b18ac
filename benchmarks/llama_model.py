"""The benchmark model shared by bench_model.py and equivalence_model.py: a LLaMA-style
decoder from a transformers config (random weights), and its command-line arguments."""

from __future__ import annotations

import argparse

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_llama_args(ap: argparse.ArgumentParser) -> None:
    """hidden 4096, intermediate 14336, 32 heads, 8 KV heads, 4 layers, r = 384, sequence 4096."""
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=384)
    ap.add_argument("--seq", type=int, default=4096)


def llama_config(args, max_positions: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max_positions,
    )
