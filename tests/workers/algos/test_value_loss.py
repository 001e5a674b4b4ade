"""Clipped value loss.

Aspects under test:
- per-token values equal 0.5 * max((v - R)^2, (v_clip - R)^2) on hand-computed numbers;
- tokens where the clipped term wins get zero gradient, others get v - R;
- padding gives 0; a non-positive clip fails.
"""

import pytest
import torch

from rljob_workers.algos import clipped_value_loss
from tests.workers.algos.tensors import f64


def test_clipped_value_loss_matches_hand_values_and_gradient() -> None:
    values = f64([[1.0, 2.0, 0.5, 2.0, 50.0]]).requires_grad_()
    old_values = f64([[0.8, 2.5, 0.5, 1.0, 0.0]])
    returns = f64([[1.5, 2.0, 0.0, 0.0, 0.0]])
    mask = f64([[1, 1, 1, 1, 0]])

    loss = clipped_value_loss(values, old_values, returns, mask, clip=0.1)
    loss.sum().backward()

    # v_clip = (0.9, 2.4, 0.5, 1.1): 0.5 * max(0.25, 0.36), 0.5 * max(0, 0.16),
    # 0.5 * 0.25 (unchanged), 0.5 * max(4, 1.21); the last token is padding
    torch.testing.assert_close(loss.detach(), f64([[0.18, 0.08, 0.125, 2.0, 0.0]]))
    assert values.grad is not None
    torch.testing.assert_close(values.grad, f64([[0.0, 0.0, 0.5, 2.0, 0.0]]))


def test_clipped_value_loss_non_positive_clip_raises() -> None:
    values = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip must be > 0"):
        clipped_value_loss(values, values, values, values, clip=0.0)
