"""The sampling distribution: the one restriction of the logits that engines sample from and the
learner scores with.

Every engine draws tokens from ``softmax(restrict_logits(logits / T))`` and reports the log-prob
of the drawn token under that distribution; the learner's policy computes its log-probs (old,
new and reference) through the same function, so behaviour, old and new log-probs describe one
policy, and at the same weights they agree up to kernel numerics (not the 0.2 nats a nucleus of
0.8 would otherwise put between a truncated sampler and a full-softmax learner).

The order and the rules are vLLM's (v1 sampler): ``min_p`` on the tempered probabilities, then
``top_k``, then ``top_p`` on what is left (sorted ascending, tokens whose cumulative mass is at
most ``1 - top_p`` dropped, the most likely token always kept).

Tokens outside the kept set get ``torch.finfo(dtype).min`` rather than ``-inf``: their
probability is exactly 0, but entropies (``p * z``) and gradients stay finite. The learner passes
``keep`` (the sampled tokens): a sampled token that a later policy's nucleus no longer contains
is scored over the nucleus plus itself instead of getting log-prob ``-inf``; at the weights that
sampled it, it is always inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Truncation", "is_restricted", "restrict_logits"]


def is_restricted(*, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> bool:
    """Whether these settings remove any token (``top_k <= 0``, ``top_p >= 1`` and
    ``min_p <= 0`` are all off)."""
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def _check(top_p: float, min_p: float) -> None:
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def restrict_logits(
    logits: Tensor,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    keep: Tensor | None = None,
) -> Tensor:
    """``logits [..., V]`` (already divided by the temperature) with every token outside the
    sampling set pushed to the dtype's lowest value; unchanged when nothing is restricted.

    Args:
        top_k: keep the ``k`` most likely tokens (``<= 0``: all).
        top_p: keep the smallest most-likely set with mass ``>= top_p`` (``1``: all).
        min_p: keep tokens whose probability is at least ``min_p`` times the largest (``0``: all).
        keep: ``[...]`` token ids kept whatever the rules say (the sampled tokens).
    """
    _check(top_p, min_p)
    if not is_restricted(top_k=top_k, top_p=top_p, min_p=min_p):
        return logits
    lowest = torch.finfo(logits.dtype).min
    vocab = logits.shape[-1]
    out = logits
    if min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, lowest)
    if 0 < top_k < vocab or top_p < 1.0:
        ascending, order = out.sort(dim=-1)
        if 0 < top_k < vocab:
            kth = ascending[..., vocab - top_k : vocab - top_k + 1]
            ascending = ascending.masked_fill(ascending < kth, lowest)
        if top_p < 1.0:
            cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1.0 - top_p
            drop[..., -1] = False
            ascending = ascending.masked_fill(drop, lowest)
        out = torch.empty_like(out).scatter(-1, order, ascending)
    if keep is not None:
        index = keep.unsqueeze(-1)
        out = out.scatter(-1, index, logits.gather(-1, index))
    return out


@dataclass(frozen=True)
class Truncation:
    """The token restriction of a job's sampling (``rollout.sampling``: topK, topP, minP)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        _check(self.top_p, self.min_p)

    @property
    def active(self) -> bool:
        """Whether any token is ever removed."""
        return is_restricted(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def apply(self, logits: Tensor, keep: Tensor | None = None) -> Tensor:
        """``restrict_logits`` with these settings."""
        return restrict_logits(
            logits, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, keep=keep
        )
