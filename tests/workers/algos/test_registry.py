"""Algorithm registry.

Aspects under test:
- every documented name resolves to its function;
- an unknown name fails with an error that lists the valid names.
"""

import pytest

from rljob_workers.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    decoupled_ppo_policy_loss,
    get_advantage_estimator,
    get_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
)


def test_registry_known_names_resolve_to_functions() -> None:
    assert get_policy_loss("ppo-clip") is ppo_clip_policy_loss
    assert get_policy_loss("decoupled-ppo") is decoupled_ppo_policy_loss
    assert get_policy_loss("tis") is tis_policy_loss
    assert get_advantage_estimator("gae") is compute_gae_advantages
    assert get_advantage_estimator("grpo") is compute_grpo_advantages
    assert get_advantage_estimator("dr-grpo") is compute_dr_grpo_advantages
    assert set(POLICY_LOSSES) == {"ppo-clip", "decoupled-ppo", "tis", "mis"}
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "dr-grpo"}


def test_get_policy_loss_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: decoupled-ppo, mis, ppo-clip, tis"):
        get_policy_loss("ppo")


def test_get_advantage_estimator_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: dr-grpo, gae, grpo"):
        get_advantage_estimator("rloo")
