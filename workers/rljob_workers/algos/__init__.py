"""RL algorithms as pure tensor functions: advantages, losses, aggregation, DAPO shaping.

Nothing here imports an engine, a transport or ``torch.distributed``; every function takes
tensors and plain numbers and documents its shapes (``B`` sequences, ``T`` tokens).
"""

from rljob_workers.algos.advantages import (
    broadcast_advantages_to_tokens,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    group_has_signal,
)
from rljob_workers.algos.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    loss_denominator,
)
from rljob_workers.algos.dapo import (
    MAX_SAMPLING_ROUNDS,
    dynamic_sampling_keep_mask,
    overlong_reward_penalty,
)
from rljob_workers.algos.kl import (
    KL_ESTIMATORS,
    LOSS_KL_ESTIMATORS,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_reward_penalty,
)
from rljob_workers.algos.policy_loss import (
    decoupled_ppo_policy_loss,
    mis_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
)
from rljob_workers.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_policy_loss,
)
from rljob_workers.algos.stats import (
    entropy_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    whiten_with_moments,
)
from rljob_workers.algos.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "LOSS_KL_ESTIMATORS",
    "MAX_SAMPLING_ROUNDS",
    "POLICY_LOSSES",
    "AggregationMode",
    "aggregate_loss",
    "broadcast_advantages_to_tokens",
    "clipped_value_loss",
    "compute_dr_grpo_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "decoupled_ppo_policy_loss",
    "dynamic_sampling_keep_mask",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_has_signal",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_penalty",
    "loss_denominator",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mis_policy_loss",
    "overlong_reward_penalty",
    "ppo_clip_policy_loss",
    "tis_policy_loss",
    "whiten_with_moments",
]
