"""DAPO dynamic sampling and overlong shaping.

Aspects under test:
- dynamic sampling drops every member of an all-equal group and keeps mixed groups;
- the overlong penalty is 0 up to max_len - cache_len, linear to -1 at max_len, -1 beyond;
- cache_len = 0 is a hard step; bad lengths fail with a clear error.
"""

import pytest
import torch

from rljob_workers.algos import dynamic_sampling_keep_mask, overlong_reward_penalty


def test_dynamic_sampling_keep_mask_drops_all_equal_groups() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5])

    keep = dynamic_sampling_keep_mask(scores, group_size=2)

    assert keep.tolist() == [False, False, False, False, True, True, False, False]


def test_overlong_reward_penalty_breakpoints() -> None:
    lengths = torch.tensor([0, 10, 15, 16, 17.5, 20, 21, 1000])

    penalty = overlong_reward_penalty(lengths, max_len=20, cache_len=5)

    # soft window (15, 20]: (15 - len) / 5
    expected = torch.tensor([0.0, 0.0, 0.0, -0.2, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(penalty, expected, atol=1e-6, rtol=0)


def test_overlong_reward_penalty_integer_lengths_give_float_penalty() -> None:
    penalty = overlong_reward_penalty(torch.tensor([18]), max_len=20, cache_len=4)

    assert penalty.dtype == torch.get_default_dtype()
    assert penalty.tolist() == [-0.5]


def test_overlong_reward_penalty_zero_cache_is_hard_step() -> None:
    penalty = overlong_reward_penalty(torch.tensor([19, 20, 21]), max_len=20, cache_len=0)

    assert penalty.tolist() == [0.0, 0.0, -1.0]


def test_overlong_reward_penalty_cache_longer_than_max_raises() -> None:
    with pytest.raises(ValueError, match="cache_len must be in"):
        overlong_reward_penalty(torch.tensor([1]), max_len=4, cache_len=5)
