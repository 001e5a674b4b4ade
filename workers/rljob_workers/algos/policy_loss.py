"""Clipped policy-gradient losses: PPO / DAPO clip-higher, dual clip, decoupled PPO, TIS and MIS.

Shapes: ``B`` sequences, ``T`` response token positions; every tensor argument is ``[B, T]``
(log-probabilities of the sampled tokens, token-level advantages, the response mask).
Each loss returns ``(per_token_loss [B, T], metrics)``: the loss is 0 at padded positions and
is reduced by ``aggregate_loss``; metrics are plain floats averaged over the valid tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rljob_workers.algos.stats import check_same_shape, masked_mean

__all__ = [
    "BEHAVIOUR_WEIGHT_DROP",
    "decoupled_ppo_policy_loss",
    "mis_policy_loss",
    "ppo_clip_policy_loss",
    "tis_policy_loss",
]

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` so a wild token cannot overflow."""
BEHAVIOUR_WEIGHT_DROP = 5.0
"""Decoupled PPO leaves out tokens whose behaviour weight ``exp(prox - behav)`` exceeds this (as
AReaL does): such a token was sampled by a policy that almost never picks it any more, and its
weight (up to ``exp(LOG_RATIO_LIMIT)``) would otherwise dominate the batch."""


def _ratio(logp: Tensor, base_logp: Tensor) -> Tensor:
    return torch.exp(torch.clamp(logp - base_logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def _zero_padding(loss: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.to(torch.bool), loss, torch.zeros_like(loss))


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    """Ratio statistics and the k3 estimate of KL(base || current) over valid tokens."""
    valid = mask.to(torch.bool)
    if not bool(valid.any()):
        return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "approx_kl": 0.0}
    return {
        "ratio_mean": float(masked_mean(ratio, mask)),
        "ratio_min": float(ratio[valid].min()),
        "ratio_max": float(ratio[valid].max()),
        "approx_kl": float(masked_mean(ratio - 1.0 - log_ratio, mask)),
    }


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token ``max(-A r, -A clip(r))`` and where the clipped term is the active one."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _apply_dual_clip(
    loss: Tensor, advantages: Tensor, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Bound negative-advantage tokens at ``-c A``; returns the loss and where it applied."""
    if dual_clip is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    bound = -dual_clip * advantages
    applied = (advantages < 0) & (loss > bound)
    return torch.where(applied, bound, loss), applied


def ppo_clip_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with an asymmetric range (DAPO clip-higher) and optional dual clip.

    With ``r = exp(logp - old_logp)``:
    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``. ``clip_high > clip_low`` is
    DAPO's clip-higher; ``clip_high == clip_low`` is plain PPO. With ``dual_clip = c > 1``, tokens
    with ``A < 0`` are further bounded: ``loss = min(loss, -c A)`` (Ye et al., 2020), so one huge
    ratio on a bad token cannot dominate the batch. Clipped tokens get zero gradient.

    Args:
        logp: ``[B, T]`` current-policy log-probs (differentiable).
        old_logp: ``[B, T]`` log-probs of the policy that sampled the tokens.
        advantages: ``[B, T]``.
        mask: ``[B, T]``.
        clip_low: lower clip ``eps_low`` in ``[0, 1)``.
        clip_high: upper clip ``eps_high >= 0``.
        dual_clip: constant ``c > 1``, or None to disable.

    Returns:
        ``(per_token_loss [B, T], metrics)`` with ``clip_fraction``, ``dual_clip_fraction``,
        ``approx_kl`` (k3 estimate of KL(old || current)), ``ratio_mean/min/max``.
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    _check_clip(clip_low, clip_high)
    log_ratio = logp - old_logp.detach()
    ratio = _ratio(logp, old_logp.detach())
    advantages = advantages.detach()
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    loss, dual_clipped = _apply_dual_clip(loss, advantages, dual_clip)
    metrics = _ratio_metrics(ratio.detach(), log_ratio.detach(), mask)
    metrics["clip_fraction"] = float(masked_mean(clipped.to(logp.dtype), mask))
    metrics["dual_clip_fraction"] = float(masked_mean(dual_clipped.to(logp.dtype), mask))
    return _zero_padding(loss, mask), metrics


def decoupled_ppo_policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_is_weight: float | None = None,
    drop_above: float | None = BEHAVIOUR_WEIGHT_DROP,
    drop_below: float | None = None,
    sequence_level: bool = False,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO (Hilton et al., 2022): clip around the proximal policy, correct to behaviour.

    The behaviour policy (a stale rollout engine) sampled the tokens; the proximal policy (the
    trainer's weights before this update) anchors the trust region. With
    ``r = exp(logp - prox_logp)`` and the detached weight ``w = exp(prox_logp - behav_logp)``
    (capped at ``max_is_weight`` when given):
    ``loss = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, with the surrogate
    dual-clipped first when ``dual_clip`` is set. Tokens whose raw weight exceeds
    ``drop_above`` (or fall below ``drop_below``) are left out (loss and gradient 0); with
    ``sequence_level`` the whole response is left out or kept, by the geometric mean of its
    tokens' raw weights. When ``prox_logp == behav_logp`` this is exactly
    ``ppo_clip_policy_loss``.

    Args:
        logp: ``[B, T]`` current-policy log-probs (differentiable).
        prox_logp: ``[B, T]`` proximal-policy log-probs.
        behav_logp: ``[B, T]`` behaviour-policy (rollout engine) log-probs.
        advantages: ``[B, T]``.
        mask: ``[B, T]``.
        clip_low: lower clip in ``[0, 1)``.
        clip_high: upper clip ``>= 0``.
        max_is_weight: cap on ``w`` (> 0), or None for no cap.
        drop_above: leave out tokens with a larger raw weight (> 0), or None to keep all.
        drop_below: leave out tokens with a smaller raw weight (> 0), or None to keep all.
        sequence_level: apply ``drop_above``/``drop_below`` to each row's geometric-mean
            weight ``exp(mean(prox_logp - behav_logp))`` over its valid tokens.
        dual_clip: dual-clip constant ``c > 1`` (as in ``ppo_clip_policy_loss``), or None.

    Returns:
        ``(per_token_loss [B, T], metrics)``: the PPO metrics plus ``is_weight_mean``,
        ``is_weight_max``, ``is_weight_capped_fraction`` and ``is_weight_dropped_fraction``
        (over the tokens kept), and ``dual_clip_fraction``.
    """
    check_same_shape(
        logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask
    )
    _check_clip(clip_low, clip_high)
    bounds = (("max_is_weight", max_is_weight), ("drop_above", drop_above))
    for name, value in (*bounds, ("drop_below", drop_below)):
        if value is not None and value <= 0.0:
            raise ValueError(f"{name} must be > 0 (or None), got {value}")
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    advantages = advantages.detach()
    ratio = _ratio(logp, prox_logp)
    surrogate, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    surrogate, dual_clipped = _apply_dual_clip(surrogate, advantages, dual_clip)
    raw_weight = _ratio(prox_logp, behav_logp)
    weight = raw_weight if max_is_weight is None else torch.clamp(raw_weight, max=max_is_weight)
    dropped = mask.to(torch.bool) & _outside(
        raw_weight, prox_logp - behav_logp, mask, drop_below, drop_above, sequence_level
    )
    kept = torch.where(dropped, torch.zeros_like(mask), mask)
    metrics = _ratio_metrics(ratio.detach(), (logp - prox_logp).detach(), kept)
    metrics["clip_fraction"] = float(masked_mean(clipped.to(logp.dtype), kept))
    metrics["dual_clip_fraction"] = float(masked_mean(dual_clipped.to(logp.dtype), kept))
    metrics.update(_weight_metrics(raw_weight, weight, kept))
    metrics["is_weight_dropped_fraction"] = float(masked_mean(dropped.to(logp.dtype), mask))
    return _zero_padding(weight * surrogate, kept), metrics


def _outside(
    weight: Tensor,
    log_weight: Tensor,
    mask: Tensor,
    below: float | None,
    above: float | None,
    sequence_level: bool,
) -> Tensor:
    """Where the weight leaves ``[below, above]`` (per token, or per row by its geometric mean,
    broadcast over the row's tokens)."""
    if sequence_level:
        tokens = mask.sum(dim=-1).clamp(min=1.0)
        mean_log = (log_weight * mask).sum(dim=-1) / tokens
        weight = torch.exp(torch.clamp(mean_log, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        weight = weight.unsqueeze(-1).expand_as(mask)
    outside = torch.zeros_like(mask, dtype=torch.bool)
    if above is not None:
        outside |= weight > above
    if below is not None:
        outside |= weight < below
    return outside


def _weight_metrics(raw_weight: Tensor, weight: Tensor, mask: Tensor) -> dict[str, float]:
    valid = mask.to(torch.bool)
    capped = (raw_weight > weight).to(weight.dtype)
    return {
        "is_weight_mean": float(masked_mean(weight, mask)) if bool(valid.any()) else 1.0,
        "is_weight_max": float(weight[valid].max()) if bool(valid.any()) else 1.0,
        "is_weight_capped_fraction": float(masked_mean(capped, mask)),
    }


def tis_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clip times a truncated importance weight for the rollout/trainer mismatch (TIS).

    The rollout engine's log-probs (``behav_logp``) differ from the trainer's recomputation of
    the same policy (``old_logp``: other kernels, precision, or a stale version). With
    ``r = exp(logp - old_logp)`` and the detached ``w = min(exp(old_logp - behav_logp), tis_cap)``:
    ``loss = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    Args:
        logp: ``[B, T]`` current-policy log-probs (differentiable).
        old_logp: ``[B, T]`` trainer log-probs of the sampling policy.
        behav_logp: ``[B, T]`` rollout-engine log-probs of the sampled tokens.
        advantages: ``[B, T]``.
        mask: ``[B, T]``.
        clip_low: lower clip in ``[0, 1)``.
        clip_high: upper clip ``>= 0``.
        tis_cap: truncation ``C > 0`` of the importance weight.
        dual_clip: dual-clip constant ``c > 1``, or None.

    Returns:
        ``(per_token_loss [B, T], metrics)`` as ``decoupled_ppo_policy_loss``.
    """
    if tis_cap <= 0.0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    return decoupled_ppo_policy_loss(
        logp,
        old_logp,
        behav_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        max_is_weight=tis_cap,
        drop_above=None,
        dual_clip=dual_clip,
    )


def mis_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    low: float,
    high: float,
    level: str = "token",
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Masked importance sampling (MIS): PPO clip weighted by ``w = exp(old - behav)``, with the
    tokens whose ``w`` leaves ``[low, high]`` masked out instead of truncated (TIS) or kept.

    ``level="sequence"`` masks whole responses by the geometric mean of their tokens' weights
    (``exp`` of the mean log-ratio), so one band means the same for short and long answers.
    Masked tokens give no loss and no gradient; ``is_weight_dropped_fraction`` counts them.

    Args:
        logp, old_logp, behav_logp, advantages, mask: as ``tis_policy_loss``.
        clip_low, clip_high, dual_clip: as ``ppo_clip_policy_loss``.
        low: ``0 < low < 1``; high: ``> 1``.
        level: ``token`` or ``sequence``.

    Returns:
        ``(per_token_loss [B, T], metrics)`` as ``decoupled_ppo_policy_loss``.
    """
    if not 0.0 < low < 1.0 < high:
        raise ValueError(f"mis needs 0 < low < 1 < high, got low={low} high={high}")
    if level not in ("token", "sequence"):
        raise ValueError(f"mis level must be token or sequence, got {level!r}")
    return decoupled_ppo_policy_loss(
        logp,
        old_logp,
        behav_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        drop_above=high,
        drop_below=low,
        sequence_level=level == "sequence",
        dual_clip=dual_clip,
    )
