"""KL estimators.

Aspects under test:
- k1, k2, k3 equal their formulas on hand-computed probabilities;
- k3 is zero for identical policies and never negative;
- the estimator table names k1, k2, k3.
"""

import math

import torch

from rljob_workers.algos import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from rljob_workers.algos.kl import KL_VALUE_LIMIT


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


def test_kl_k3_huge_log_ratio_is_clamped_to_the_limit() -> None:
    # one token the reference likes e^30 times more than the policy: unclamped k3 ~ 5e8
    logp = torch.tensor([[-31.0, -1.0]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)

    value = kl_k3(logp, ref_logp)

    assert value[0, 0] <= 10.0 and value[0, 0] == KL_VALUE_LIMIT
    assert value[0, 1] == 0.0
