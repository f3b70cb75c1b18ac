"""``DoRALinear``: an nn.Module around ``dora_linear`` with PEFT's initialisation and merge."""

from __future__ import annotations

import math

import torch
from torch import nn

from doracheck.kernels.constants import eps

from .functional import dora_linear, factored_norm


class DoRALinear(nn.Module):
    """A frozen linear layer with a DoRA adapter (PEFT semantics, no fan_in_fan_out).

    Parameters: ``weight`` (d_out, d_in, frozen), ``bias`` (d_out, frozen, optional), ``lora_A``
    (r, d_in), ``lora_B`` (d_out, r, zero at init), ``magnitude`` (d_out,), initialised to the row
    norms of W + s·B·A (= ||W_i|| at init) as PEFT does. ``merge()`` folds the adapter into the
    weight, ``W' = g ⊙_rows (W + s·B·A)`` in fp32 cast once, keeping the norm it used so that
    ``unmerge()`` can invert it; while merged, forward is a plain ``F.linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int = 16,
        lora_alpha: float = 32,
        *,
        use_rslora: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        detach_norm: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if r < 1:
            raise ValueError(f"r: expected a rank >= 1, got {r}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.lora_alpha = lora_alpha
        self.use_rslora = use_rslora
        self.scaling = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.dropout = float(dropout)
        self.detach_norm = detach_norm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **factory), requires_grad=False) if bias else None
        self.lora_A = nn.Parameter(torch.empty(r, in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **factory))
        self.magnitude = nn.Parameter(torch.ones(out_features, **factory))
        self.merged = False
        self.register_buffer("_merged_norm", None, persistent=False)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.reset_adapter()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        r: int = 16,
        lora_alpha: float = 32,
        use_rslora: bool = False,
        dropout: float = 0.0,
        detach_norm: bool = True,
    ) -> DoRALinear:
        """Wrap an existing ``nn.Linear`` (its weight and bias are shared, not copied)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(
            linear.in_features,
            linear.out_features,
            r,
            lora_alpha,
            use_rslora=use_rslora,
            dropout=dropout,
            bias=False,
            detach_norm=detach_norm,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        layer.weight = linear.weight  # type: ignore[assignment]  # shared Parameter, not a copy
        layer.weight.requires_grad_(False)
        layer.bias = linear.bias
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        layer.reset_adapter()
        return layer

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """PEFT's init: A Kaiming-uniform (a = sqrt(5)), B = 0, magnitude = ||W + s·B·A|| rows."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B.zero_()
        self.magnitude.copy_(self._norm().to(self.magnitude.dtype))

    def _norm(self) -> torch.Tensor:
        norm = factored_norm(self.weight, self.lora_A, self.lora_B, self.scaling)
        assert isinstance(norm, torch.Tensor)
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return nn.functional.linear(x, self.weight, self.bias)
        return dora_linear(
            x,
            self.weight,
            self.lora_A,
            self.lora_B,
            self.magnitude,
            self.scaling,
            self.bias,
            dropout_p=self.dropout,
            training=self.training,
            detach_norm=self.detach_norm,
        )

    @torch.no_grad()
    def merge(self) -> None:
        """W ← g ⊙_rows (W + s·B·A), in fp32, cast once to W's dtype."""
        if self.merged:
            raise RuntimeError("DoRALinear.merge: the adapter is already merged")
        n = self._norm()
        g = self.magnitude.to(torch.float32) / torch.clamp_min(n, eps())
        bad = int((~torch.isfinite(g) | (g == 0)).sum())
        if bad:  # unmerge divides by g: a zero or non-finite g would write NaN into the shared W
            raise ValueError(f"DoRALinear.merge: {bad} features have g = m/n zero or not finite; unmerge could not restore W")
        dense = self.weight.to(torch.float32) + self.scaling * (self.lora_B.to(torch.float32) @ self.lora_A.to(torch.float32))
        self.weight.copy_((g[:, None] * dense).to(self.weight.dtype))
        self._merged_norm = n
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W ← W' / g - s·B·A with the g used by ``merge`` (in fp32, cast once)."""
        if not self.merged:
            raise RuntimeError("DoRALinear.unmerge: the adapter is not merged")
        g = self.magnitude.to(torch.float32) / torch.clamp_min(self._merged_norm, eps())
        lora = self.scaling * (self.lora_B.to(torch.float32) @ self.lora_A.to(torch.float32))
        self.weight.copy_((self.weight.to(torch.float32) / g[:, None] - lora).to(self.weight.dtype))
        self._merged_norm = None  # type: ignore[assignment]
        self.merged = False

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"scaling={self.scaling:g}, dropout={self.dropout}, merged={self.merged}"
        )
