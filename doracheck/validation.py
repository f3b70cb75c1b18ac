"""Input checks for the public API: every message names the tensor and says expected vs got."""

from __future__ import annotations

import math
import numbers
import sys
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DoraDims(NamedTuple):
    d_in: int
    d_out: int
    r: int


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}")


def _require_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_scaling(scaling) -> float:
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise ValueError(f"scaling: expected a real number (lora_alpha / r), got {type(scaling).__name__}")
    try:
        value = float(scaling)
    except OverflowError:  # an int or Fraction beyond fp64's range (10**400): not finite as a float
        raise ValueError("scaling: expected a finite number, got a value beyond float64's range") from None
    if not math.isfinite(value):
        raise ValueError(f"scaling: expected a finite number, got {value}")
    return value


def check_weights(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, *, fan_in_fan_out: bool) -> DoraDims:
    """Shapes, dtypes and devices of W, A, B; returns (d_in, d_out, r)."""
    for name, t in (("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B)):
        _require_tensor(name, t)
    if weight.dim() != 2:
        layout = "(d_in, d_out)" if fan_in_fan_out else "(d_out, d_in)"
        raise ValueError(f"weight: expected a 2-D tensor {layout}, got shape {tuple(weight.shape)}")
    d_out, d_in = (weight.shape[1], weight.shape[0]) if fan_in_fan_out else weight.shape
    if lora_A.dim() != 2:
        raise ValueError(f"lora_A: expected a 2-D tensor (r, d_in={d_in}), got shape {tuple(lora_A.shape)}")
    r = lora_A.shape[0]
    if r < 1:
        raise ValueError(f"lora_A: expected rank r >= 1 rows, got shape {tuple(lora_A.shape)}")
    _require_shape("lora_A", lora_A, (r, d_in))
    _require_shape("lora_B", lora_B, (d_out, r))
    _require_same_device({"weight": weight, "lora_A": lora_A, "lora_B": lora_B})
    return DoraDims(int(d_in), int(d_out), int(r))


def _require_same_device(tensors: dict[str, torch.Tensor]) -> None:
    items = list(tensors.items())
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} (the device of {ref_name}), got {t.device}")


def _plainly_valid(x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p, fan_in_fan_out) -> bool:
    """The common call in one expression (it runs every forward; the checks below cost tens of µs on a slow
    host). False sends the call through those, which name the problem: so strict is fine, lenient not."""
    T = torch.Tensor
    F = FLOAT_DTYPES
    if not (isinstance(x, T) and isinstance(weight, T) and isinstance(lora_A, T) and isinstance(lora_B, T)
            and isinstance(magnitude, T) and (bias is None or isinstance(bias, T))):
        return False
    if weight.dim() != 2 or lora_A.dim() != 2 or x.dim() < 1:
        return False
    d_out, d_in = weight.shape[::-1] if fan_in_fan_out else weight.shape
    r = lora_A.shape[0]
    dev = weight.device
    return (
        x.dtype in F and weight.dtype in F and lora_A.dtype in F and lora_B.dtype in F and magnitude.dtype in F
        and r >= 1 and lora_A.shape[1] == d_in and lora_B.shape == (d_out, r) and x.shape[-1] == d_in
        and magnitude.shape == (d_out,)
        and x.device == dev and lora_A.device == dev and lora_B.device == dev and magnitude.device == dev
        and (bias is None or (bias.dtype in F and bias.shape == (d_out,) and bias.device == dev))
        and type(scaling) in (float, int) and abs(scaling) <= sys.float_info.max and type(dropout_p) in (float, int)
        and 0.0 <= dropout_p < 1.0)


def check_dora_inputs(
    x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    magnitude: torch.Tensor, scaling, bias: torch.Tensor | None, *, dropout_p: float, fan_in_fan_out: bool,
    dropout_mask: torch.Tensor | None = None,
) -> DoraDims:
    """All of ``dora_linear``'s arguments; raises ValueError naming the offending one."""
    if dropout_mask is None and _plainly_valid(x, weight, lora_A, lora_B, magnitude, scaling, bias, dropout_p, fan_in_fan_out):
        d_out, d_in = weight.shape[::-1] if fan_in_fan_out else weight.shape
        return DoraDims(d_in, d_out, lora_A.shape[0])
    _require_tensor("x", x)
    dims = check_weights(weight, lora_A, lora_B, fan_in_fan_out=fan_in_fan_out)
    if x.dim() < 1 or x.shape[-1] != dims.d_in:
        raise ValueError(f"x: expected shape (..., {dims.d_in}) (d_in of weight), got {tuple(x.shape)}")
    _require_tensor("magnitude", magnitude)
    _require_shape("magnitude", magnitude, (dims.d_out,))
    devices = {"x": x, "weight": weight, "magnitude": magnitude}
    if bias is not None:
        _require_tensor("bias", bias)
        _require_shape("bias", bias, (dims.d_out,))
        devices["bias"] = bias
    _require_same_device(devices)
    check_scaling(scaling)
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p: expected 0 <= p < 1, got {dropout_p}")
    if dropout_mask is not None:
        if not isinstance(dropout_mask, torch.Tensor):
            raise ValueError(f"dropout_mask: expected a torch.Tensor, got {type(dropout_mask).__name__}")
        try:
            ok = torch.broadcast_shapes(dropout_mask.shape, x.shape) == x.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"dropout_mask: expected a shape broadcastable to x {tuple(x.shape)}, got {tuple(dropout_mask.shape)}"
            )
        _require_same_device({"x": x, "dropout_mask": dropout_mask})
    return dims
