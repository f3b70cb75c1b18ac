"""Small PEFT DoRA models for the integration and training-loop tests (CPU-sized, seeded).

A two-layer LLaMA built from a transformers config (no download), PEFT DoRA on every linear
layer of its decoder, with lora_B and the magnitude moved off their init so that every term
of DoRA (and every gradient) is non-trivial from the first step.
"""

from __future__ import annotations

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 96


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def perturb_adapters(model, seed: int) -> None:
    """lora_B off zero and the magnitude off ||W|| (PEFT's init makes both trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
            elif "lora_magnitude_vector" in name:
                p.mul_((1 + 0.01 * torch.randn(p.shape, generator=gen)).to(p.dtype))


def dora_model(seed: int = 0, dropout: float = 0.0, dtype: torch.dtype = torch.float32, **config):
    import peft

    model = peft.get_peft_model(
        tiny_llama(seed, dtype),
        peft.LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=TARGETS, lora_dropout=dropout, **config),
    )
    perturb_adapters(model, seed + 1)
    return model


def tokens(seed: int = 0, batch: int = 2, length: int = 12, device="cpu"):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def trainable(model):
    """(name, parameter) of every trainable parameter, in a stable order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def enabled_dora_model(seed: int = 0, **kwargs):
    """``dora_model`` routed through doracheck (``enable``, norm buffers on) in eval mode, with
    the process's norm cache emptied first, as the inference-norm and armed-plan tests start."""
    from doracheck.integrations.peft import enable
    from doracheck.norm_rule import clear_norm_cache

    clear_norm_cache()
    model = dora_model(seed, **kwargs)
    enable(model)
    return model.eval()


def count_plan_runs(monkeypatch, plan_class) -> list:
    """Patch ``plan_class.run`` to record, for each call, whether the plan answered it (not
    None); returns that list (for the armed and the training plans' tests)."""
    runs: list = []
    real = plan_class.run

    def counted(self, *args):
        y = real(self, *args)
        runs.append(y is not None)
        return y

    monkeypatch.setattr(plan_class, "run", counted)
    return runs


def enabled_biased_mlp():
    """A two-layer MLP with biases, PEFT DoRA on both linear layers (lora_B off zero), routed
    through doracheck, the process's norm cache emptied first (seeded)."""
    import peft

    from doracheck.integrations.peft import enable
    from doracheck.norm_rule import clear_norm_cache

    clear_norm_cache()
    torch.manual_seed(3)
    base = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
    m = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["0", "2"]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return enable(m)
