"""Reduce a per-token loss ``[B, T]`` to the scalar that is back-propagated.

The mode decides how tokens and sequences are weighted:

- ``token-mean``: every valid token in the batch weighs the same (DAPO's token-level loss);
  long responses contribute more tokens.
- ``seq-mean-token-mean``: average within each sequence, then across sequences (GRPO paper);
  every sequence weighs the same, so a token of a short response weighs more.
- ``seq-mean-token-sum``: sum within each sequence, average across sequences.
- ``seq-mean-token-sum-norm``: total over all tokens divided by ``B * normaliser``, a constant
  (default ``T``) that does not depend on response lengths (Dr.GRPO).

Sequences without any valid token are left out of the ``seq-mean-*`` averages, so appending
fully padded rows or padded columns never changes the result (except ``-norm``, whose constant
is by definition tied to the padded shape unless ``normaliser`` is given).

Every mode is ``numerator / denominator``. Under data parallelism each rank holds part of the
batch: pass ``denominator`` = (the sum of every rank's ``loss_denominator``) / world size, so
that the gradients DDP averages equal those of the whole batch on one rank (a rank with fewer
tokens then weighs exactly its tokens, and an empty rank adds nothing).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rljob_workers.algos.stats import check_same_shape, masked_mean, masked_sum, safe_divide

__all__ = ["AGGREGATION_MODES", "AggregationMode", "aggregate_loss", "loss_denominator"]

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)


def loss_denominator(mask: Tensor, mode: str, *, normaliser: float | None = None) -> Tensor:
    """What ``mode`` divides by for ``mask [B, T]``, a 0-d tensor.

    ``token-mean``: the valid tokens; ``seq-mean-*``: the sequences with a valid token;
    ``seq-mean-token-sum-norm``: those sequences times ``normaliser`` (default ``T``).
    """
    _check_mode(mode, normaliser)
    weights = mask.to(torch.get_default_dtype()) if not mask.is_floating_point() else mask
    if mode == "token-mean":
        return weights.sum()
    nonempty = (weights.sum(dim=-1) != 0).to(weights.dtype).sum()
    if mode == "seq-mean-token-sum-norm":
        constant = float(mask.shape[-1]) if normaliser is None else normaliser
        if constant <= 0:
            raise ValueError(f"normaliser must be > 0, got {constant}")
        return nonempty * constant
    return nonempty


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normaliser: float | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Aggregate ``per_token_loss [B, T]`` over ``mask [B, T]`` into a scalar.

    Args:
        per_token_loss: ``[B, T]``.
        mask: ``[B, T]``.
        mode: one of ``AGGREGATION_MODES`` (see the module docstring).
        normaliser: the constant of ``seq-mean-token-sum-norm``; defaults to ``T``.
            Only valid with that mode.
        denominator: divide by this instead of ``loss_denominator(mask, mode)`` (the global
            count under data parallelism, see the module docstring).

    Returns:
        A 0-d tensor; 0 when the mask (or the denominator) is empty.
    """
    check_same_shape(per_token_loss=per_token_loss, mask=mask)
    local = loss_denominator(mask, mode, normaliser=normaliser)
    if mode in ("token-mean", "seq-mean-token-sum-norm"):
        numerator = masked_sum(per_token_loss, mask)
    elif mode == "seq-mean-token-mean":
        numerator = _sum_over_nonempty(masked_mean(per_token_loss, mask, dim=-1), mask)
    else:
        numerator = _sum_over_nonempty(masked_sum(per_token_loss, mask, dim=-1), mask)
    divisor = local if denominator is None else torch.as_tensor(denominator).to(numerator)
    return safe_divide(numerator, divisor.to(numerator.dtype))


def _check_mode(mode: str, normaliser: float | None) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}"
        )
    if normaliser is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"normaliser only applies to mode 'seq-mean-token-sum-norm', not {mode!r}")


def _sum_over_nonempty(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``per_sequence [B]`` over the sequences whose mask has any weight."""
    nonempty = (mask.to(per_sequence.dtype).sum(dim=-1) != 0).to(per_sequence.dtype)
    return (per_sequence * nonempty).sum()
