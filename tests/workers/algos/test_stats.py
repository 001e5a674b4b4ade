"""Masked statistics and entropy.

Aspects under test:
- masked mean / variance / whitening equal hand-computed values and ignore padded garbage;
- an empty mask gives 0, not NaN, and keeps gradients finite;
- entropy from logits equals -sum p log p, and stays finite for huge logits.
"""

import math

import pytest
import torch

from rljob_workers.algos import (
    entropy_from_logits,
    masked_mean,
    masked_moments,
    masked_var,
    masked_whiten,
    whiten_with_moments,
)
from tests.workers.algos.tensors import f64

VALUES = [[1.0, 2.0, 3.0], [4.0, math.nan, 100.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


def test_masked_mean_ignores_padding_overall_and_per_row() -> None:
    values, mask = f64(VALUES), f64(MASK)

    assert float(masked_mean(values, mask)) == pytest.approx(2.5)
    assert masked_mean(values, mask, dim=-1).tolist() == [2.0, 4.0]


def test_masked_var_unbiased_and_biased_match_hand_values() -> None:
    values, mask = f64(VALUES), f64(MASK)

    # squared deviations from 2.5: 2.25, 0.25, 0.25, 2.25
    assert float(masked_var(values, mask)) == pytest.approx(5 / 3)
    assert float(masked_var(values, mask, unbiased=False)) == pytest.approx(5 / 4)


def test_masked_whiten_matches_hand_values_and_zeroes_padding() -> None:
    whitened = masked_whiten(f64(VALUES), f64(MASK))

    scale = 1 / math.sqrt(5 / 3 + 1e-8)
    expected = f64([[-1.5 * scale, -0.5 * scale, 0.5 * scale], [1.5 * scale, 0, 0]])
    torch.testing.assert_close(whitened, expected, atol=1e-6, rtol=0)


def test_masked_mean_empty_mask_zero_with_finite_gradient() -> None:
    values = torch.ones(2, 3, requires_grad=True)

    result = masked_mean(values, torch.zeros(2, 3))
    result.backward()

    assert float(result.detach()) == 0.0
    assert values.grad is not None and bool(torch.isfinite(values.grad).all())


def test_entropy_from_logits_matches_hand_values() -> None:
    logits = f64([[[0.0, 0.0], [0.0, math.log(3)], [1000.0, 1000.0]]])

    entropy = entropy_from_logits(logits)

    # p = (1/2, 1/2), (1/4, 3/4), (1/2, 1/2)
    quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy, f64([[math.log(2), quarter, math.log(2)]]))


def test_whiten_with_moments_of_every_part_equals_whitening_the_whole() -> None:
    torch.manual_seed(0)
    values = torch.randn(6, 5) * 3 + 1
    mask = (torch.rand(6, 5) > 0.3).float()
    parts = [(values[:2], mask[:2]), (values[2:], mask[2:])]  # two ranks' rows
    moments = sum(masked_moments(v, m) for v, m in parts)

    whitened = torch.cat([whiten_with_moments(v, m, moments) for v, m in parts])

    torch.testing.assert_close(whitened, masked_whiten(values, mask), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(whiten_with_moments(*parts[0], moments), masked_whiten(*parts[0]))
