"""Policy losses: PPO / DAPO clip-higher, dual clip, decoupled PPO, TIS, MIS.

Aspects under test:
- per-token values equal the hand-computed surrogate, padding gives 0;
- ratio 1 => token-mean loss == -mean(advantage);
- clipped tokens get zero gradient, unclipped ones get -A * r (times the IS weight);
- DAPO clip with eps_high == eps_low equals the textbook symmetric PPO clip;
- clip-higher lets positive-advantage ratios between 1+eps_low and 1+eps_high through;
- dual clip bounds negative-advantage tokens at -c * A;
- metrics: clip fraction, ratio stats, approx KL, IS-weight stats;
- decoupled PPO reduces to PPO when proximal == behaviour; TIS weight is capped and detached;
- MIS masks tokens (or whole responses, by the geometric mean of their weights) whose weight
  leaves [low, high] and weights the rest, by hand-computed values; the band's edges are kept;
- invalid hyper-parameters fail with a clear error.
"""

import math

import pytest
import torch

from rljob_workers.algos import (
    aggregate_loss,
    decoupled_ppo_policy_loss,
    mis_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
)
from tests.workers.algos.tensors import f64

RATIOS = [[1.5, 0.5, 1.1], [0.7, 1.25, 100.0]]
ADVANTAGES = [[1.0, 1.0, -1.0], [-1.0, 2.0, 5.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _logps(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old_logp = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    logp = (old_logp + torch.log(f64(ratios))).requires_grad_()
    return logp, old_logp


def test_ppo_clip_asymmetric_matches_hand_values() -> None:
    logp, old_logp = _logps(RATIOS)

    loss, _ = ppo_clip_policy_loss(
        logp, old_logp, f64(ADVANTAGES), f64(MASK), clip_low=0.2, clip_high=0.28
    )

    # max(-A r, -A clip(r, 0.8, 1.28)) per token
    expected = f64([[-1.28, -0.5, 1.1], [0.8, -2.5, 0.0]])
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=0)


def test_ppo_clip_clipped_tokens_zero_gradient() -> None:
    logp, old_logp = _logps(RATIOS)

    loss, _ = ppo_clip_policy_loss(
        logp, old_logp, f64(ADVANTAGES), f64(MASK), clip_low=0.2, clip_high=0.28
    )
    loss.sum().backward()

    # d(-A r)/dlogp = -A r where unclipped; 0 where clipped (r=1.5, A>0; r=0.7, A<0) or padded
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, f64([[0.0, -0.5, 1.1], [0.0, -2.5, 0.0]]))


def test_ppo_clip_metrics_match_hand_values() -> None:
    logp, old_logp = _logps(RATIOS)

    _, metrics = ppo_clip_policy_loss(
        logp, old_logp, f64(ADVANTAGES), f64(MASK), clip_low=0.2, clip_high=0.28
    )

    valid = [1.5, 0.5, 1.1, 0.7, 1.25]
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["dual_clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.01)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in valid) / 5)


def test_ppo_clip_ratio_one_token_mean_is_minus_mean_advantage() -> None:
    logp = torch.full((2, 3), -0.7, dtype=torch.float64)
    advantages, mask = f64([[1, 2, 3], [4, 99, 99]]), f64([[1, 1, 1], [1, 0, 0]])

    loss, metrics = ppo_clip_policy_loss(logp, logp, advantages, mask, clip_low=0.2, clip_high=0.2)

    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["approx_kl"] == 0.0


def test_ppo_clip_equal_eps_equals_textbook_symmetric_clip() -> None:
    torch.manual_seed(0)
    logp, old_logp = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    advantages, mask = torch.randn(4, 6, dtype=torch.float64), torch.ones(4, 6)

    loss, _ = ppo_clip_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2)

    ratio = torch.exp(logp - old_logp)
    textbook = -torch.min(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    torch.testing.assert_close(loss, textbook)


def test_ppo_clip_higher_passes_positive_ratios_below_upper_bound() -> None:
    logp, old_logp = _logps([[1.25, 1.25]])
    advantages, mask = f64([[2.0, -2.0]]), f64([[1, 1]])

    symmetric, _ = ppo_clip_policy_loss(
        logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2
    )
    higher, _ = ppo_clip_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28)

    # A>0, r=1.25: clipped at 1.2 symmetrically, free under clip-higher; A<0 is unaffected
    torch.testing.assert_close(symmetric.detach(), f64([[-2.4, 2.5]]))
    torch.testing.assert_close(higher.detach(), f64([[-2.5, 2.5]]))


def test_ppo_dual_clip_bounds_negative_advantage_tokens() -> None:
    logp, old_logp = _logps([[5.0, 2.0, 5.0]])
    advantages, mask = f64([[-1.0, -1.0, 1.0]]), f64([[1, 1, 1]])

    loss, metrics = ppo_clip_policy_loss(
        logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    loss.sum().backward()

    # A<0, r=5: min(max(5, 1.28), 3) = 3; A<0, r=2: 2 (under the bound); A>0, r=5: -1.28
    torch.testing.assert_close(loss.detach(), f64([[3.0, 2.0, -1.28]]))
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, f64([[0.0, 2.0, 0.0]]))
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)


def test_ppo_dual_clip_not_above_one_raises() -> None:
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_policy_loss(logp, logp, logp, logp, clip_low=0.2, clip_high=0.2, dual_clip=1.0)


def test_ppo_clip_low_out_of_range_raises() -> None:
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_low must be in"):
        ppo_clip_policy_loss(logp, logp, logp, logp, clip_low=1.0, clip_high=0.2)


def _decoupled_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # r = exp(logp - prox) = (1.5, 0.9, 1.0); w = exp(prox - behav) = (2, 0.5, 4)
    prox = f64([[-1.0, -1.0, -1.0]])
    behav = prox - torch.log(f64([[2.0, 0.5, 4.0]]))
    logp = (prox + torch.log(f64([[1.5, 0.9, 1.0]]))).requires_grad_()
    return logp, prox, behav


def test_decoupled_ppo_matches_hand_values_and_gradient() -> None:
    logp, prox, behav = _decoupled_inputs()
    advantages, mask = f64([[1.0, 1.0, -2.0]]), f64([[1, 1, 1]])

    loss, metrics = decoupled_ppo_policy_loss(
        logp, prox, behav, advantages, mask, clip_low=0.2, clip_high=0.28
    )
    loss.sum().backward()

    # w * max(-A r, -A clip(r)): 2 * -1.28, 0.5 * -0.9, 4 * 2
    torch.testing.assert_close(loss.detach(), f64([[-2.56, -0.45, 8.0]]))
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, f64([[0.0, -0.45, 8.0]]))
    assert metrics["is_weight_mean"] == pytest.approx(6.5 / 3)
    assert metrics["is_weight_max"] == pytest.approx(4.0)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_decoupled_ppo_max_is_weight_caps_weight() -> None:
    logp, prox, behav = _decoupled_inputs()

    loss, metrics = decoupled_ppo_policy_loss(
        logp, prox, behav, f64([[1.0, 1.0, -2.0]]), f64([[1, 1, 1]]),
        clip_low=0.2, clip_high=0.28, max_is_weight=1.5,
    )  # fmt: skip

    torch.testing.assert_close(loss.detach(), f64([[-1.92, -0.45, 3.0]]))
    assert metrics["is_weight_capped_fraction"] == pytest.approx(2 / 3)


def test_decoupled_ppo_proximal_equals_behaviour_reduces_to_ppo_clip() -> None:
    torch.manual_seed(1)
    logp, old_logp = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    advantages = torch.randn(3, 5, dtype=torch.float64)
    mask = (torch.rand(3, 5) > 0.3).to(torch.float64)

    decoupled, _ = decoupled_ppo_policy_loss(
        logp, old_logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28
    )
    ppo, _ = ppo_clip_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28)

    torch.testing.assert_close(decoupled, ppo)


def test_tis_weight_truncated_at_cap_and_detached() -> None:
    old = f64([[-1.0, -1.0]]).requires_grad_()
    behav = (old.detach() - torch.log(f64([[3.0, 0.5]]))).requires_grad_()
    logp = (old.detach() + torch.log(f64([[1.0, 1.2]]))).requires_grad_()

    loss, metrics = tis_policy_loss(
        logp, old, behav, f64([[1.0, 1.0]]), f64([[1, 1]]), clip_low=0.2, clip_high=0.2, tis_cap=2.0
    )
    loss.sum().backward()

    # w = min(exp(old - behav), 2) = (2, 0.5); loss = -w * A * r = (-2, -0.6)
    torch.testing.assert_close(loss.detach(), f64([[-2.0, -0.6]]))
    assert old.grad is None and behav.grad is None
    assert metrics["is_weight_capped_fraction"] == pytest.approx(0.5)


def test_tis_non_positive_cap_raises() -> None:
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        tis_policy_loss(logp, logp, logp, logp, logp, clip_low=0.2, clip_high=0.2, tis_cap=0.0)


def test_decoupled_ppo_behaviour_weight_above_cap_drops_token() -> None:
    # token 0: w = e^10 (a behaviour policy that almost never picks this token): AReaL drops it
    prox = f64([[-1.0, -1.0]])
    behav = f64([[-11.0, -1.0]])
    logp = prox.clone().requires_grad_()
    advantages, mask = f64([[1.0, 1.0]]), f64([[1, 1]])

    loss, metrics = decoupled_ppo_policy_loss(
        logp, prox, behav, advantages, mask, clip_low=0.2, clip_high=0.2
    )
    loss.sum().backward()

    torch.testing.assert_close(loss.detach(), f64([[0.0, -1.0]]))
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, f64([[0.0, -1.0]]))
    assert metrics["is_weight_dropped_fraction"] == pytest.approx(0.5)
    assert metrics["is_weight_max"] == pytest.approx(1.0)


def _weighted(weights: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """old = -1 everywhere, behaviour = old - log(w), logp = old (ratio 1)."""
    old = torch.full((len(weights), len(weights[0])), -1.0, dtype=torch.float64)
    behav = old - torch.log(f64(weights))
    return old.clone().requires_grad_(), old, behav


def test_mis_token_level_masks_weights_outside_the_band_by_hand() -> None:
    logp, old, behav = _weighted([[3.0, 0.4, 1.5, 0.5]])
    advantages, mask = f64([[1.0, 1.0, 1.0, -2.0]]), f64([[1, 1, 1, 1]])

    loss, metrics = mis_policy_loss(
        logp, old, behav, advantages, mask, clip_low=0.2, clip_high=0.2, low=0.5, high=2.0
    )
    loss.sum().backward()

    # kept: w = 1.5 (A 1) and w = 0.5 (on the edge, A -2): -w A r = -1.5, 1.0; masked: 0
    torch.testing.assert_close(loss.detach(), f64([[0.0, 0.0, -1.5, 1.0]]))
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, f64([[0.0, 0.0, -1.5, 1.0]]))
    assert metrics["is_weight_dropped_fraction"] == pytest.approx(0.5)
    assert metrics["is_weight_mean"] == pytest.approx(1.0)  # over the kept tokens
    assert metrics["is_weight_max"] == pytest.approx(1.5)


def test_mis_sequence_level_masks_whole_responses_by_geometric_mean() -> None:
    # row 0: weights 4 and 1/4, geometric mean 1: kept, each token keeps its own weight;
    # row 1: 3 and 3: masked whole; row 2: 1.2 and padding (its 100 does not count): kept
    logp, old, behav = _weighted([[4.0, 0.25], [3.0, 3.0], [1.2, 100.0]])
    advantages, mask = f64([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]), f64([[1, 1], [1, 1], [1, 0]])

    loss, metrics = mis_policy_loss(
        logp, old, behav, advantages, mask,
        clip_low=0.2, clip_high=0.2, low=0.5, high=2.0, level="sequence",
    )  # fmt: skip
    token, _ = mis_policy_loss(
        logp, old, behav, advantages, mask, clip_low=0.2, clip_high=0.2, low=0.5, high=2.0
    )

    torch.testing.assert_close(loss.detach(), f64([[-4.0, -0.25], [0.0, 0.0], [-1.2, 0.0]]))
    assert metrics["is_weight_dropped_fraction"] == pytest.approx(2 / 5)
    # the token level masks 4, 1/4, 3 and 3 instead
    torch.testing.assert_close(token.detach(), f64([[0.0, 0.0], [0.0, 0.0], [-1.2, 0.0]]))


def test_mis_with_equal_logprobs_is_ppo_clip_and_bad_bands_raise() -> None:
    torch.manual_seed(2)
    logp, old = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    advantages, mask = torch.randn(3, 5, dtype=torch.float64), torch.ones(3, 5, dtype=torch.float64)
    mis, _ = mis_policy_loss(
        logp, old, old, advantages, mask, clip_low=0.2, clip_high=0.28, low=0.5, high=2.0
    )
    ppo, _ = ppo_clip_policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(mis, ppo)
    for low, high in ((0.0, 2.0), (1.0, 2.0), (0.5, 1.0)):
        with pytest.raises(ValueError, match="0 < low < 1 < high"):
            mis_policy_loss(logp, old, old, advantages, mask, clip_low=0.2, clip_high=0.2,
                            low=low, high=high)  # fmt: skip


@pytest.mark.parametrize("loss_name", ["decoupled-ppo", "tis"])
def test_off_policy_losses_dual_clip_bounds_negative_advantage_tokens(loss_name: str) -> None:
    # r = 10 on a token with A = -1: PPO clip gives 10 (max of -A r and -A clip(r)); dual clip 3
    prox = f64([[-2.0, -2.0]])
    logp = (prox + f64([[math.log(10.0), 0.0]])).requires_grad_()
    advantages, mask = f64([[-1.0, -1.0]]), f64([[1, 1]])
    kwargs = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}

    if loss_name == "tis":
        loss, metrics = tis_policy_loss(logp, prox, prox, advantages, mask, tis_cap=2.0, **kwargs)
    else:
        loss, metrics = decoupled_ppo_policy_loss(logp, prox, prox, advantages, mask, **kwargs)
    loss.sum().backward()

    torch.testing.assert_close(loss.detach(), f64([[3.0, 1.0]]))
    assert logp.grad is not None
    assert logp.grad[0, 0] == 0.0
    assert metrics["dual_clip_fraction"] == pytest.approx(0.5)
