"""Masked statistics and entropy: the small tensor helpers every loss builds on.

Shapes: ``B`` sequences, ``T`` token positions, ``V`` vocabulary entries. A mask is ``[B, T]``
(bool or float, 1 = a real response token, 0 = padding) and may hold fractional weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_same_shape",
    "entropy_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "safe_divide",
    "whiten_with_moments",
]

WHITEN_EPS = 1e-8


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ``ValueError`` naming every argument when the given tensors differ in shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; all must have the same shape")


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0 (with finite gradients)."""
    nonzero = denominator != 0
    safe_denominator = torch.where(nonzero, denominator, torch.ones_like(denominator))
    return torch.where(nonzero, numerator / safe_denominator, torch.zeros_like(numerator))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values * mask``; padded entries never leak in, even when they hold NaN or inf.

    Args:
        values: ``[B, T]`` (any shape equal to ``mask``'s).
        mask: ``[B, T]``, bool or float weights.
        dim: reduce this dimension only; ``None`` reduces everything to a scalar.
    """
    weights = mask.to(values.dtype)
    weighted = torch.where(weights != 0, values * weights, torch.zeros_like(values))
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the masked entries; 0 where the mask is empty.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``, bool or float weights.
        dim: reduce this dimension only (``[B, T]`` -> ``[B]`` for ``dim=-1``); ``None`` -> scalar.
    """
    weights = mask.to(values.dtype)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    return safe_divide(masked_sum(values, weights, dim), count)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the masked entries, a scalar.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``, bool or float weights.
        unbiased: apply Bessel's correction ``n / (n - 1)`` (0 when ``n <= 1``).
    """
    weights = mask.to(values.dtype)
    centred = values - masked_mean(values, weights)
    variance = masked_mean(centred * centred, weights)
    if not unbiased:
        return variance
    count = weights.sum()
    return safe_divide(variance * count, count - 1) * (count > 1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True) -> Tensor:
    """Normalise ``values`` to unit variance (and zero mean) over the masked entries.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]``.
        shift_mean: subtract the mean; when False the mean is kept and only the scale changes.

    Returns:
        ``[B, T]``, 0 at padded entries.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.to(torch.bool), whitened, torch.zeros_like(whitened))


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` of the masked entries, float64: what ranks add up to
    whiten over the global batch (``whiten_with_moments``)."""
    weights = mask.to(torch.float64)
    wide = values.to(torch.float64)
    return torch.stack([weights.sum(), masked_sum(wide, weights), masked_sum(wide * wide, weights)])


def whiten_with_moments(values: Tensor, mask: Tensor, moments: Tensor) -> Tensor:
    """``masked_whiten`` with the mean and the (Bessel-corrected) variance taken from
    ``moments`` (``masked_moments`` summed over every rank's rows) instead of from ``values``:
    each rank's advantages are whitened by the global batch's statistics.

    Args:
        values: ``[B, T]``, this rank's rows.
        mask: ``[B, T]``.
        moments: ``[3]``, ``[count, sum, sum of squares]`` over all ranks.
    """
    count, total, squares = (float(v) for v in moments.tolist())
    mean = total / count if count else 0.0
    variance = max(squares / count - mean * mean, 0.0) if count else 0.0
    variance = variance * count / (count - 1) if count > 1 else 0.0
    whitened = (values - mean) * (variance + WHITEN_EPS) ** -0.5
    return torch.where(mask.to(torch.bool), whitened, torch.zeros_like(whitened))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at every position, in nats.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, which stays finite for large logits.

    Args:
        logits: ``[B, T, V]``.

    Returns:
        ``[B, T]``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
