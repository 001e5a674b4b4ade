"""DAPO's data-side techniques: dynamic sampling and overlong reward shaping (Yu et al., 2025).

The loss-side techniques live elsewhere: clip-higher is ``ppo_clip_policy_loss`` with
``clip_high > clip_low``; the token-level loss is ``aggregate_loss(..., "token-mean")``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rljob_workers.algos.advantages import group_has_signal

__all__ = ["MAX_SAMPLING_ROUNDS", "dynamic_sampling_keep_mask", "overlong_reward_penalty"]

MAX_SAMPLING_ROUNDS = 4
"""Dynamic sampling: most generation rounds (colocated) or batches' worth of filtered groups
(disaggregated) spent filling one batch before training on what there is."""


def dynamic_sampling_keep_mask(scores: Tensor, *, group_size: int) -> Tensor:
    """Which samples to keep: False for every member of a group whose rewards are all equal.

    Such a group (all correct or all wrong) has zero group-relative advantage and so gives no
    gradient; DAPO filters it out and samples more prompts instead.

    Args:
        scores: ``[B]`` task rewards (accuracy, before any shaping such as the overlong
            penalty, as in the DAPO paper) in contiguous groups of ``group_size``.
        group_size: samples per prompt, ``>= 2``.

    Returns:
        ``[B]`` bool.
    """
    return group_has_signal(scores, group_size=group_size)


def overlong_reward_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> Tensor:
    """Soft overlong punishment, added to the task reward.

    With ``L = max_len`` and ``C = cache_len`` the breakpoints are:

    - ``length <= L - C``: 0 (no penalty);
    - ``L - C < length <= L``: ``((L - C) - length) / C``, linear from 0 (at ``L - C``) to -1
      (at ``L``);
    - ``length > L``: -1.

    ``cache_len = 0`` degenerates to a hard step: 0 up to ``L``, -1 beyond.

    Args:
        lengths: ``[B]`` response lengths in tokens (int or float).
        max_len: ``L > 0``.
        cache_len: ``C`` with ``0 <= C <= L``.

    Returns:
        ``[B]`` float penalties in ``[-1, 0]``.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be in [0, max_len={max_len}], got {cache_len}")
    length = lengths.to(torch.get_default_dtype())
    soft_start = max_len - cache_len
    linear = (soft_start - length) / max(cache_len, 1)
    penalty = torch.where(length <= soft_start, torch.zeros_like(length), linear)
    return torch.where(length > max_len, torch.full_like(length, -1.0), penalty)
