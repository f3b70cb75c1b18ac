"""The records a DoRA call passes between its parts: the layer's arguments, what a forward
keeps for its backward, and which gradients are wanted (docs/design.md section 5)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from doracheck.kernels.backends import Backend, by_name


class LayerArgs(NamedTuple):
    """One DoRA layer's parameters and settings for one call (validated, scaling a float)."""

    weight: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    magnitude: torch.Tensor
    bias: torch.Tensor | None
    scaling: float
    fan_in_fan_out: bool = False
    dropout_p: float = 0.0
    detach_norm: bool = True


class Saved(NamedTuple):
    """What a forward keeps for its backward. Tensors (the first ``SAVED_TENSORS`` fields) go
    through ``save_for_backward``; ``backend``, ``from_output`` and ``variant`` ride on the ctx.
    x2: x as (T, d_in) in the compute dtype; keep: the bool keep-mask (T, d_in) with dropout;
    xa: x_d·Aᵀ (T, r) or None (recomputed); h: z = base + s·lora (T, d_out), or the output
    y = g⊙z itself when ``from_output``; g: m / max(n, eps) fp32; n, n_safe: the norm and
    max(n, eps); U, G: W·Aᵀ and A·Aᵀ (the exact-norm backward only)."""

    x2: torch.Tensor
    keep: torch.Tensor | None
    xa: torch.Tensor | None
    h: torch.Tensor | None
    g: torch.Tensor
    n: torch.Tensor
    n_safe: torch.Tensor
    U: torch.Tensor | None
    G: torch.Tensor | None
    backend: Backend
    from_output: bool
    variant: Any  # planner.Variant

    def flags(self) -> tuple:
        """The non-tensor fields, as plain values a ctx can hold (the backend by name)."""
        return self.backend.name, self.from_output, self.variant

    @classmethod
    def rebuild(cls, tensors, flags) -> Saved:
        name, from_output, variant = flags
        return cls(*tensors[:SAVED_TENSORS], by_name(name), from_output, variant)  # type: ignore[call-arg]


SAVED_TENSORS = 9  # Saved's leading fields, the tensors (or None) that go through save_for_backward


class Need(NamedTuple):
    """Which gradients the caller wants (autograd's ``needs_input_grad``, by name)."""

    dx: bool
    dW: bool
    dA: bool
    dB: bool
    dm: bool
    db: bool


class Grads(NamedTuple):
    dx: torch.Tensor | None
    dW: torch.Tensor | None
    dA: torch.Tensor | None
    dB: torch.Tensor | None
    dm: torch.Tensor | None
    db: torch.Tensor | None
