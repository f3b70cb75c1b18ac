"""An armed layer's plan on a CUDA GPU (marked ``gpu``; skipped without CUDA): the compose
launched directly (``compose_triton.InferCompose``) is bitwise Triton's own launch of the same
kernel, and a PEFT model's armed forwards through their plans are bitwise the general path,
also after the tensors a plan launched with moved (``integrations/peft_armed.py``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def direct_launches(monkeypatch):
    from doracheck.kernels import fast_launch

    launches = []
    real = fast_launch.run_entry

    def counted(*args):
        launches.append(1)
        return real(*args)

    monkeypatch.setattr(fast_launch, "run_entry", counted)
    fast_launch.clear()
    yield launches
    fast_launch.clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_infer_compose_launches_directly_and_is_bitwise_tritons_launch(dtype, with_bias, direct_launches, monkeypatch):
    """A token count seen before launches directly (no ``_compose``, Triton's or fast_launch's
    argument handling); a new one, or a misaligned base, through ``_compose``. Bitwise
    ``lora_up_compose_triton`` every time."""
    from doracheck.kernels import compose_triton
    from doracheck.kernels.compose_triton import InferCompose, lora_up_compose_triton

    general = []
    real_compose = compose_triton._compose

    def counted_compose(*args):
        general.append(1)
        return real_compose(*args)

    gen = torch.Generator().manual_seed(5)
    d_out, r = 1031, 96
    B = (torch.randn(d_out, r, generator=gen) / 10).to("cuda", dtype)
    m = (1 + torch.randn(d_out, generator=gen) / 10).to("cuda", dtype)
    n_safe = (1 + torch.rand(d_out, generator=gen)).to("cuda")
    bias = torch.randn(d_out, generator=gen).to("cuda", dtype) if with_bias else None
    plan = InferCompose(d_out, r, 2.0)
    counts = [7, 1, 1, 16, 1, 33, 7]

    def planned(base, xa, T):
        """(calls of _compose, direct launches) made by the plan's call."""
        before = len(general), len(direct_launches)
        with monkeypatch.context() as patch:
            patch.setattr(compose_triton, "_compose", counted_compose)
            plan(base, xa, T, B, m, bias, n_safe)
        return len(general) - before[0], len(direct_launches) - before[1]

    for step, T in enumerate(counts):
        base = torch.randn(1, T, d_out, generator=gen).to("cuda", dtype)
        xa = torch.randn(1, T, r, generator=gen).to("cuda", dtype)
        want = lora_up_compose_triton(base.clone().view(T, d_out), xa.view(T, r), B, m, 2.0, bias, base_has_bias=True,
                                      n_safe=n_safe)
        seen = T in counts[:step]
        calls, direct = planned(base, xa, T)
        assert calls == (0 if seen else 1)
        if seen:
            assert direct == 1
        assert torch.equal(base.view(T, d_out), want)
    # Misaligned (2 bytes past an aligned address): Triton specialises on alignment, so not the kept kernel.
    spare = torch.empty(d_out + 8, device="cuda", dtype=dtype)
    odd = spare[1:d_out + 1].view(1, 1, d_out)
    odd.copy_(torch.randn(1, 1, d_out, generator=gen).to("cuda", dtype))
    xa = torch.randn(1, 1, r, generator=gen).to("cuda", dtype)
    want = lora_up_compose_triton(odd.clone().view(1, d_out), xa.view(1, r), B, m, 2.0, bias, base_has_bias=True,
                                  n_safe=n_safe)
    assert planned(odd, xa, 1) == (1, 0)
    assert torch.equal(odd.view(1, d_out), want)


def test_armed_decode_through_plans_is_bitwise_the_general_path_on_cuda(monkeypatch, direct_launches):
    from peft_models import dora_model, tokens

    from doracheck.integrations import peft as integration
    from doracheck.integrations.peft import enable
    from doracheck.norm_cache import clear_norm_cache

    clear_norm_cache()
    m = dora_model(0, dtype=torch.bfloat16).cuda().eval()
    enable(m)

    def decode(n_new: int):
        """Greedy generation (prefill, then one token per step through the KV cache): the logits."""
        ids = tokens(7, batch=1, length=9, device="cuda")
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        return torch.stack(out.logits)

    got = decode(4)
    assert len(direct_launches) >= 14 * 2  # from the third token on, every layer's compose launched directly
    with monkeypatch.context() as patch:
        patch.setattr(integration, "armed_forward", lambda *a: None)
        want = decode(4)
    assert torch.equal(got, want)
    # B moved (a write through .data, the old tensor still alive and unchanged): a plan that kept
    # the old address would read the old B. The model's next forward refreshes the norm buffers.
    layer = m.base_model.model.model.layers[1].mlp.down_proj
    B = layer.lora_B["default"].weight
    old = B.data
    B.data = old * 1.5
    got_after = decode(3)
    with monkeypatch.context() as patch:
        patch.setattr(integration, "armed_forward", lambda *a: None)
        want_after = decode(3)
    assert torch.equal(got_after, want_after) and not torch.equal(got_after, got[:3])
    del old


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_a_plan_on_another_gpu_than_the_current_one_gives_the_same_bits(monkeypatch):
    """An armed model on cuda:1 decoding while cuda:0 is current (accelerate's device_map leaves
    the current device alone): its plans launch on cuda:1, bitwise as when cuda:1 is current."""
    from peft_models import dora_model, tokens

    from doracheck.integrations.peft import enable
    from doracheck.norm_cache import clear_norm_cache

    clear_norm_cache()
    m = dora_model(0, dtype=torch.bfloat16).to("cuda:1").eval()
    enable(m)
    ids = tokens(7, batch=1, length=9, device="cuda:1")

    def decode(current: int):
        with torch.cuda.device(current), torch.no_grad():
            out = m.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        torch.cuda.synchronize("cuda:1")
        return torch.stack(out.logits)

    on_1 = decode(1)
    assert torch.equal(decode(0), on_1) and torch.equal(decode(0), on_1)  # the second through the kept plans
