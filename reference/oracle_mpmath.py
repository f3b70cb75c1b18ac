"""The mpmath oracle: exact-then-rounded DoRA quantities for small shapes.

Inputs are binary floating-point numbers, so V = W + s·B·A, its squared row norms and the three terms are
polynomials in them with finitely many bits. ``working_precision`` picks a precision at which these sums of
products are exact (product bits + exponent spread + summation length); square roots and the division in g are
then correctly rounded at it, so the float64 result is wrong only with probability about 2**-(prec - 53).
``mpmath.workprec`` sets and restores it; results are float64 tensors (mpf to nearest)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from typing import NamedTuple

import mpmath
import torch

EPS = 1e-12
MAX_ELEMENTS = 1 << 16  # d_out·d_in·(r+1) and T·d_out·d_in above this are refused: mpmath is slow


class MpNormTerms(NamedTuple):
    base: torch.Tensor
    cross: torch.Tensor
    lora: torch.Tensor
    norm: torch.Tensor


def _exponent_span(values: Iterable[float]) -> int:
    exps = [math.frexp(v)[1] for v in values if v != 0.0 and math.isfinite(v)]
    return (max(exps) - min(exps)) if exps else 0


def working_precision(*tensors: torch.Tensor, scalars: tuple[float, ...] = (), degree: int = 6) -> int:
    """Bits at which degree-``degree`` polynomials in these inputs are exact: 53·degree for a product of
    ``degree`` doubles, plus for a sum their exponent spread (<= degree × the inputs') and log2(#terms)."""
    values: list[float] = list(scalars)
    count = 1
    for t in tensors:
        flat = t.detach().to(torch.float64).reshape(-1).tolist()
        values.extend(flat)
        count += len(flat)
    span = _exponent_span(values)
    return 53 * degree + degree * span + 2 * max(1, count).bit_length() + 64


@contextmanager
def precision(bits: int):
    """Set mpmath's working precision to ``bits`` inside the block, restoring it after."""
    with mpmath.workprec(int(bits)):
        yield


def _mp_matrix(t: torch.Tensor) -> list[list[mpmath.mpf]]:
    rows = t.detach().to(torch.float64).cpu()
    if rows.dim() == 1:
        rows = rows[None]
    return [[mpmath.mpf(v) for v in row] for row in rows.tolist()]


def _to_tensor(values: list, shape) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64).reshape(shape)


def _rows(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return weight.t() if fan_in_fan_out else weight


def _check_size(name: str, n: int) -> None:
    if n > MAX_ELEMENTS:
        raise ValueError(f"{name}: {n} elementary terms is too large for the mpmath oracle (limit {MAX_ELEMENTS})")


def _lora_and_v(W, A, B, s):
    d_out, d_in, r = len(W), len(W[0]), len(A)
    P = [[mpmath.fsum(B[i][k] * A[k][j] for k in range(r)) for j in range(d_in)] for i in range(d_out)]
    V = [[W[i][j] + s * P[i][j] for j in range(d_in)] for i in range(d_out)]
    return P, V


def mp_norm_terms(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *, fan_in_fan_out=False
) -> MpNormTerms:
    """base, cross, lora and norm (d_out,) of V = W + s·B·A, each correctly rounded to float64."""
    Wt = _rows(weight, fan_in_fan_out)
    d_out, d_in = Wt.shape
    _check_size("mp_norm_terms", d_out * d_in * (lora_A.shape[0] + 1))
    with precision(working_precision(Wt, lora_A, lora_B, scalars=(float(scaling),))):
        W, A, B = _mp_matrix(Wt), _mp_matrix(lora_A), _mp_matrix(lora_B)
        s = mpmath.mpf(float(scaling))
        P, V = _lora_and_v(W, A, B, s)
        base = [mpmath.fsum(w * w for w in row) for row in W]
        cross = [mpmath.fsum(W[i][j] * P[i][j] for j in range(d_in)) for i in range(d_out)]
        lora = [mpmath.fsum(p * p for p in row) for row in P]
        norm = [mpmath.sqrt(mpmath.fsum(v * v for v in row)) for row in V]
        shape = (d_out,)
        return MpNormTerms(*(_to_tensor(t, shape) for t in (base, cross, lora, norm)))


def mp_magnitude_scale(
    weight, lora_A, lora_B, magnitude, scaling, *, fan_in_fan_out=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, g - 1) with g = m / max(n, eps), both correctly rounded to float64."""
    Wt = _rows(weight, fan_in_fan_out)
    _check_size("mp_magnitude_scale", Wt.shape[0] * Wt.shape[1] * (lora_A.shape[0] + 1))
    with precision(working_precision(Wt, lora_A, lora_B, magnitude, scalars=(float(scaling),))):
        g = _mp_scale(Wt, lora_A, lora_B, magnitude, scaling)
        return _to_tensor(g, magnitude.shape), _to_tensor([gi - 1 for gi in g], magnitude.shape)


def _mp_scale(Wt, lora_A, lora_B, magnitude, scaling):
    W, A, B = _mp_matrix(Wt), _mp_matrix(lora_A), _mp_matrix(lora_B)
    m = _mp_matrix(magnitude)[0]
    _, V = _lora_and_v(W, A, B, mpmath.mpf(float(scaling)))
    eps = mpmath.mpf(EPS)
    return [m[i] / max(mpmath.sqrt(mpmath.fsum(v * v for v in V[i])), eps) for i in range(len(V))]


def mp_dora_forward(
    x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    magnitude: torch.Tensor, scaling: float, bias: torch.Tensor | None = None, *,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """y = b + g⊙(x·Vᵀ) (no dropout), correctly rounded to float64, shape (..., d_out)."""
    Wt = _rows(weight, fan_in_fan_out)
    d_out, d_in = Wt.shape
    x2 = x.reshape(-1, d_in)
    _check_size("mp_dora_forward", max(x2.shape[0], 1) * d_out * (d_in + lora_A.shape[0]))
    extra = (bias,) if bias is not None else ()
    with precision(working_precision(x2, Wt, lora_A, lora_B, magnitude, *extra, scalars=(float(scaling),))):
        g = _mp_scale(Wt, lora_A, lora_B, magnitude, scaling)
        W, A, B = _mp_matrix(Wt), _mp_matrix(lora_A), _mp_matrix(lora_B)
        _, V = _lora_and_v(W, A, B, mpmath.mpf(float(scaling)))
        X = _mp_matrix(x2) if x2.shape[0] else []
        b = _mp_matrix(bias)[0] if bias is not None else [mpmath.mpf(0)] * d_out
        y = [b[j] + g[j] * mpmath.fsum(X[t][i] * V[j][i] for i in range(d_in)) for t in range(len(X)) for j in range(d_out)]
        return _to_tensor(y, (*x.shape[:-1], d_out))


def mp_compose(
    base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The compose b + g⊙(base + s·lora) on given (already rounded) inputs, correctly rounded to
    float64: the quantity the 0.5-ulp property of docs/design.md section 2 is stated for."""
    flat_base = base.detach().to(torch.float64).reshape(-1, base.shape[-1])
    flat_lora = lora.detach().to(torch.float64).reshape(-1, base.shape[-1])
    _check_size("mp_compose", flat_base.numel())
    extra = (bias,) if bias is not None else ()
    with precision(working_precision(flat_base, flat_lora, g, *extra, scalars=(float(scaling),), degree=3)):
        s = mpmath.mpf(float(scaling))
        gs = _mp_matrix(g)[0]
        b = _mp_matrix(bias)[0] if bias is not None else [mpmath.mpf(0)] * len(gs)
        out = [
            b[j] + gs[j] * (mpmath.mpf(bv) + s * mpmath.mpf(lv))
            for brow, lrow in zip(flat_base.tolist(), flat_lora.tolist())
            for j, (bv, lv) in enumerate(zip(brow, lrow))]
        return _to_tensor(out, base.shape)
