"""The benchmark model (DESIGN section 7), shared by the model-level drivers.

A LLaMA-style decoder from a transformers config with random weights: hidden 4096, intermediate
14336, 32 heads, 8 KV heads, 4 layers, bf16; adapters r = 384, alpha = 768 on all seven linear
layers of every decoder layer, lora_B drawn non-zero (a zero B would make DoRA's norm trivial).

Implementations (``build``): ``peft_lora_bf16`` / ``peft_lora_fp32`` (PEFT LoRA), ``peft_dora_bf16``
/ ``peft_dora_fp32`` (PEFT DoRA), ``doracheck_bf16`` / ``doracheck_fp32`` (the same PEFT DoRA model
after ``doracheck.integrations.peft.enable``). The suffix is the adapter dtype (PEFT's
``autocast_adapter_dtype``: fp32 is PEFT's default); activations are bf16 throughout. The short
names ``lora``, ``doracheck``, ``peft_dora`` mean the bf16 ones.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import harness
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IMPLS = ["peft_lora_bf16", "peft_lora_fp32", "peft_dora_bf16", "peft_dora_fp32", "doracheck_bf16", "doracheck_fp32"]
SHORT = {"lora": "peft_lora_bf16", "doracheck": "doracheck_bf16", "peft_dora": "peft_dora_bf16"}
SMOKE = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "layers": 1, "rank": 8, "seq": 32, "vocab": 256}


def add_llama_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=384)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)


def apply_smoke(args) -> None:
    """The tiny model of ``--smoke`` runs."""
    for key, value in SMOKE.items():
        setattr(args, key, value)


def impl_name(name: str) -> str:
    name = SHORT.get(name, name)
    if name not in IMPLS:
        raise SystemExit(f"unknown implementation {name!r}; expected one of {', '.join([*SHORT, *IMPLS])}")
    return name


def shape_label(args) -> str:
    return f"llama h{args.hidden} i{args.intermediate} L{args.layers} r{args.rank} seq{args.seq}"


def llama_config(args, max_positions: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_positions,
    )


def build(impl: str, args, *, checkpointing: bool = True, enable: Callable | None = None, max_positions: int = 0,
          dtype: torch.dtype = torch.bfloat16):
    """The PEFT model of ``impl`` on ``args.device`` (same seed, so the same weights for every impl).
    ``enable``: the ``enable`` function to apply for doracheck (ab.py passes each commit's)."""
    import peft
    import transformers

    impl = impl_name(impl)
    kind, adapter_dtype = impl.rsplit("_", 1)
    torch.manual_seed(0)
    config = llama_config(args, max_positions or args.seq + 256)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, use_dora="lora" not in kind, target_modules=TARGETS)
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype == "fp32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.01))
    if kind == "doracheck":
        if enable is None:
            from doracheck.integrations.peft import enable
        enable(model)
    model.generation_config.pad_token_id = 0
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def token_ids(args, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(args.device)


def train_step(model, ids: torch.Tensor, optimizer: str = "adamw_fused", compiled: bool = False,
               backend: str = "inductor") -> Callable[[], None]:
    """One training step as users run it: forward, backward, ``optimizer.step()`` (AdamW fused on
    CUDA, or foreach; ``none``: no update, labelled so), ``zero_grad``. ``compiled``: the model
    under ``torch.compile`` (``backend``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = None
    if optimizer != "none":
        fused = optimizer == "adamw_fused" and ids.is_cuda
        opt = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=not fused)
    run = torch.compile(model, backend=backend) if compiled else model

    def step():
        model.train()
        run(ids, labels=ids).loss.backward()
        if opt is not None:
            opt.step()
        for p in params:
            p.grad = None

    return step


def inference(model, ids: torch.Tensor) -> Callable[[], None]:
    def forward():
        model.eval()
        with torch.no_grad():
            model(ids)

    return forward


class Decoder:
    """Greedy decode of ``new_tokens`` tokens after a 32-token prompt, as users serve it: eager
    with the dynamic KV cache, or (``compiled``) with a static KV cache, with which transformers'
    ``generate`` compiles the forward itself on a GPU (``torch.compile``, mode "reduce-overhead":
    CUDA graphs; its ``CompileConfig`` default). ``rate()`` decodes once and returns tokens/s;
    ``tokens`` holds the first output, ``changed`` counts later outputs that differed from it."""

    def __init__(self, model, args, new_tokens: int, compiled: bool = False):
        self.model, self.device = model, args.device
        self.prompt = token_ids(args, 32, seed=2)
        self.kwargs: dict = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
        if compiled:
            self.kwargs["cache_implementation"] = "static"
        self.tokens: torch.Tensor | None = None
        self.changed = 0

    def rate(self) -> float:
        model = self.model
        model.eval()
        checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
        if checkpointing:  # generation uses the KV cache; checkpointing would turn it off
            model.gradient_checkpointing_disable()
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                out = model.generate(self.prompt, **self.kwargs)
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
        finally:
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.tokens is None:
            self.tokens = out
        elif not torch.equal(out, self.tokens):
            self.changed += 1
        return (out.shape[1] - self.prompt.shape[1]) / seconds


def peak_gib(fn: Callable[[], None], device: str) -> float:
    """Peak memory allocated during one call of ``fn`` above what was allocated before it (GiB)."""
    return harness.peak_bytes(fn, device) / 2**30


def count_routed(model) -> int:
    """How many PEFT LoRA layers' DoRA variant is doracheck's (``enable`` swaps it per adapter)."""
    count = 0
    for module in model.modules():
        for variant in (getattr(module, "lora_variant", None) or {}).values():
            count += type(variant).__module__.split(".")[0] != "peft"
    return count
