"""Advantage estimators.

Aspects under test:
- GAE equals the hand-computed recursion, ignores padded rewards/values, skips mask holes;
- GAE with lam=1, gamma=1 equals reward-to-go minus value;
- GRPO and Dr.GRPO equal their formulas on hand-computed groups;
- a group with equal rewards gets exactly zero advantage, the same groups dynamic sampling drops;
- GRPO is invariant to a per-group positive affine change of the scores (property);
- bad layouts fail with a clear error; per-sequence advantages broadcast to valid tokens only.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_workers.algos import (
    broadcast_advantages_to_tokens,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    dynamic_sampling_keep_mask,
)
from tests.workers.algos.tensors import f64


def test_gae_full_sequence_matches_hand_recursion() -> None:
    rewards, values, mask = f64([[0, 0, 1]]), f64([[0.5, 0.6, 0.7]]), f64([[1, 1, 1]])

    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)

    # delta = (0.04, 0.03, 0.3); A2 = 0.3, A1 = 0.03 + 0.72 * 0.3, A0 = 0.04 + 0.72 * 0.246
    torch.testing.assert_close(advantages, f64([[0.21712, 0.246, 0.3]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, f64([[0.71712, 0.846, 1.0]]), atol=1e-6, rtol=0)


def test_gae_right_padding_ignores_padded_values_and_rewards() -> None:
    rewards, values, mask = f64([[0, 2, 7]]), f64([[1.0, 0.5, 9.0]]), f64([[1, 1, 0]])

    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)

    # A1 = 2 - 0.5 = 1.5; A0 = (0.9 * 0.5 - 1.0) + 0.72 * 1.5 = 0.53
    torch.testing.assert_close(advantages, f64([[0.53, 1.5, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, f64([[1.53, 2.0, 0.0]]), atol=1e-6, rtol=0)


def test_gae_mask_hole_is_skipped_not_bootstrapped() -> None:
    rewards, values, mask = f64([[0, 5, 1]]), f64([[0.5, 7.0, 0.7]]), f64([[1, 0, 1]])

    advantages, _ = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)

    # the hole is invisible: A2 = 0.3, A0 = (0.9 * 0.7 - 0.5) + 0.72 * 0.3 = 0.346
    torch.testing.assert_close(advantages, f64([[0.346, 0.0, 0.3]]), atol=1e-6, rtol=0)


def test_gae_lambda_one_gamma_one_equals_reward_to_go_minus_value() -> None:
    rewards = f64([[0, 0, 1], [0.5, 1.0, 4.0]])
    values = f64([[0.5, 0.6, 0.7], [0.2, 0.3, 8.0]])
    mask = f64([[1, 1, 1], [1, 1, 0]])

    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)

    # reward-to-go: row 0 (1, 1, 1); row 1 (1.5, 1.0, padding)
    torch.testing.assert_close(advantages, f64([[0.5, 0.4, 0.3], [1.3, 0.7, 0.0]]))
    torch.testing.assert_close(returns, f64([[1.0, 1.0, 1.0], [1.5, 1.0, 0.0]]))


def test_gae_outputs_are_detached() -> None:
    values = f64([[0.5, 0.6]]).requires_grad_()

    advantages, returns = compute_gae_advantages(
        f64([[0, 1]]), values, f64([[1, 1]]), gamma=1.0, lam=0.95
    )

    assert not advantages.requires_grad and not returns.requires_grad


def test_gae_shape_mismatch_raises_naming_arguments() -> None:
    with pytest.raises(ValueError, match="values"):
        compute_gae_advantages(f64([[0, 1]]), f64([[0, 1, 2]]), f64([[1, 1]]), gamma=1, lam=1)


def test_grpo_groups_match_hand_formula() -> None:
    scores = f64([1, 0, 0, 3, 1, 2])

    advantages = compute_grpo_advantages(scores, group_size=3)

    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: mean 2, unbiased std 1
    s1 = math.sqrt(1 / 3) + 1e-6
    s2 = 1.0 + 1e-6
    expected = f64([(2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1, 1 / s2, -1 / s2, 0.0])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_dr_grpo_groups_match_hand_formula() -> None:
    advantages = compute_dr_grpo_advantages(f64([1, 0, 0, 3, 1, 2]), group_size=3)

    torch.testing.assert_close(
        advantages, f64([2 / 3, -1 / 3, -1 / 3, 1, -1, 0]), atol=1e-6, rtol=0
    )


def test_grpo_equal_rewards_group_zero_and_dropped_by_dynamic_sampling() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must be exact anyway
    scores = f64([0.1, 0.1, 0.1, 0.7, 0.2, 0.2, 1.0, 1.0, 1.0])

    grpo = compute_grpo_advantages(scores, group_size=3)
    dr_grpo = compute_dr_grpo_advantages(scores, group_size=3)
    keep = dynamic_sampling_keep_mask(scores, group_size=3)

    zero_groups = (grpo.reshape(3, 3) == 0).all(dim=1).repeat_interleave(3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert torch.equal(~keep, zero_groups)
    assert torch.equal(dr_grpo[~keep], torch.zeros(6, dtype=torch.float64))


@settings(max_examples=25, deadline=None)
@given(
    scores=st.lists(st.integers(-5, 5), min_size=4, max_size=4),
    scale=st.floats(0.5, 4.0),
    shift=st.floats(-3.0, 3.0),
)
def test_grpo_positive_affine_scores_same_advantages(
    scores: list[int], scale: float, shift: float
) -> None:
    base = f64(scores)

    plain = compute_grpo_advantages(base, group_size=4, eps=0.0)
    moved = compute_grpo_advantages(base * scale + shift, group_size=4, eps=0.0)

    torch.testing.assert_close(moved, plain, atol=1e-6, rtol=0)
    assert abs(float(plain.sum())) < 1e-9


def test_grpo_batch_not_multiple_of_group_raises() -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size 3"):
        compute_grpo_advantages(f64([1, 2, 3, 4]), group_size=3)


def test_grpo_group_of_one_raises() -> None:
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        compute_dr_grpo_advantages(f64([1, 2]), group_size=1)


def test_broadcast_advantages_fills_valid_tokens_only() -> None:
    tokens = broadcast_advantages_to_tokens(f64([2.0, -1.0]), f64([[1, 1, 0], [1, 0, 0]]))

    assert tokens.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
