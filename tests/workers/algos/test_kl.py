"""KL estimators.

Aspects under test:
- k1, k2, k3 equal their formulas on hand-computed probabilities;
- k3 is zero for identical policies and never negative;
- the estimator table names k1, k2, k3.
"""

import math

import torch

from rljob_workers.algos import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3


def test_kl_estimators_match_hand_values() -> None:
    # p = (0.5, 0.2), ref = (0.25, 0.4)
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    ref_logp = torch.log(torch.tensor([[0.25, 0.4]], dtype=torch.float64))
    ln2 = math.log(2)

    torch.testing.assert_close(kl_k1(logp, ref_logp), torch.tensor([[ln2, -ln2]]).double())
    torch.testing.assert_close(kl_k2(logp, ref_logp), torch.tensor([[ln2**2 / 2] * 2]).double())
    # exp(-ln2) + ln2 - 1 and exp(ln2) - ln2 - 1
    expected_k3 = torch.tensor([[0.5 + ln2 - 1, 2 - ln2 - 1]], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(logp, ref_logp), expected_k3)


def test_kl_k3_identical_policies_zero_otherwise_non_negative() -> None:
    torch.manual_seed(0)
    logp, ref_logp = torch.randn(4, 8), torch.randn(4, 8)

    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, 8))
    assert bool((kl_k3(logp, ref_logp) >= 0).all())


def test_kl_estimator_table_names_all_estimators() -> None:
    assert {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3} == KL_ESTIMATORS
