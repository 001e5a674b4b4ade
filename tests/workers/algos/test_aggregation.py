"""Loss aggregation modes.

Aspects under test:
- each mode equals its hand-computed value on a ragged mask;
- seq-mean-token-mean weighs a short response's tokens more than token-mean does, and the
  two coincide when all responses have the same length;
- token-mean and the seq-mean modes are invariant to extra padding rows and columns (property);
- seq-mean-token-sum-norm divides by a constant; unknown modes list the valid ones.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_workers.algos import aggregate_loss
from tests.workers.algos.tensors import f64

LOSS = [[1.0, 2.0, 3.0], [10.0, 77.0, 77.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 16 / 4),
        ("seq-mean-token-mean", (6 / 3 + 10 / 1) / 2),
        ("seq-mean-token-sum", (6 + 10) / 2),
        ("seq-mean-token-sum-norm", 16 / (2 * 3)),
    ],
)
def test_aggregate_loss_ragged_mask_matches_hand_value(mode: str, expected: float) -> None:
    assert float(aggregate_loss(f64(LOSS), f64(MASK), mode)) == pytest.approx(expected)


def test_aggregate_loss_seq_mean_weighs_short_response_more_than_token_mean() -> None:
    token_mean = aggregate_loss(f64(LOSS), f64(MASK), "token-mean")
    seq_mean = aggregate_loss(f64(LOSS), f64(MASK), "seq-mean-token-mean")

    # the one-token response (loss 10) is half of seq-mean but a quarter of token-mean
    assert float(seq_mean) > float(token_mean)


def test_aggregate_loss_equal_lengths_token_and_seq_mean_agree() -> None:
    torch.manual_seed(0)
    loss, mask = torch.randn(3, 4, dtype=torch.float64), torch.ones(3, 4)

    torch.testing.assert_close(
        aggregate_loss(loss, mask, "token-mean"), aggregate_loss(loss, mask, "seq-mean-token-mean")
    )


def test_aggregate_loss_norm_mode_uses_given_constant() -> None:
    result = aggregate_loss(f64(LOSS), f64(MASK), "seq-mean-token-sum-norm", normaliser=4.0)

    assert float(result) == pytest.approx(16 / (2 * 4))


def test_aggregate_loss_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(ValueError, match="valid modes: token-mean, seq-mean-token-mean"):
        aggregate_loss(f64(LOSS), f64(MASK), "sequence-mean")


def test_aggregate_loss_normaliser_with_other_mode_raises() -> None:
    with pytest.raises(ValueError, match="normaliser only applies"):
        aggregate_loss(f64(LOSS), f64(MASK), "token-mean", normaliser=3.0)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.lists(st.floats(-10, 10), min_size=1, max_size=4), min_size=1, max_size=3),
    extra_columns=st.integers(0, 3),
    extra_rows=st.integers(0, 2),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_aggregate_loss_extra_padding_same_result(
    rows: list[list[float]], extra_columns: int, extra_rows: int, mode: str
) -> None:
    width = max(len(row) for row in rows)
    loss = f64([row + [0.0] * (width - len(row)) for row in rows])
    mask = f64([[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows])
    padded_loss = torch.full((len(rows) + extra_rows, width + extra_columns), 123.0).double()
    padded_mask = torch.zeros_like(padded_loss)
    padded_loss[: len(rows), :width] = loss
    padded_mask[: len(rows), :width] = mask

    expected = aggregate_loss(loss, mask, mode)
    torch.testing.assert_close(aggregate_loss(padded_loss, padded_mask, mode), expected)
