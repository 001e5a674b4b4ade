"""Which topology a job runs on (``spec.topology: auto`` resolved), and what follows from it."""

from __future__ import annotations

from rljob_operator.api.algorithm import is_on_policy
from rljob_operator.api.spec import ResolvedTopology, RLJobSpec
from rljob_operator.api.sync import WeightSyncMethod


def resolve_topology(spec: RLJobSpec) -> tuple[ResolvedTopology, str]:
    """The topology a job runs on, and why. First match wins:

    1. ``spec.topology`` colocated or disaggregated: used as written.
    2. auto, on-policy algorithm (ppo, grpo) without a staleness bound (``staleness.correction``
       decoupledPPO|tis|mis *and* ``staleness.maxVersions``): colocated, the only topology that
       keeps policy lag near zero.
    3. auto, ``objective: utilization`` or ``task.longChainReasoning``, and an algorithm that
       tolerates stale data (dapo, or a staleness bound as in 2): disaggregated, so long or
       uneven generations keep the rollout GPUs busy while trainers train.
    4. auto otherwise: colocated (lowest lag, fewest moving parts).

    Rule 3 asks on-policy algorithms for the same bound the validator requires on an explicit
    disaggregated topology, so auto never picks a combination that would be rejected.
    """
    if spec.topology != "auto":
        return spec.topology, f"spec.topology is {spec.topology}"
    name = spec.algorithm.name
    bounded = spec.staleness.correction != "none" and spec.staleness.max_versions is not None
    if is_on_policy(name) and not bounded:
        return "colocated", f"{name} is on-policy and spec.staleness sets no correction and bound"
    wants_throughput = spec.objective == "utilization" or spec.task.long_chain_reasoning
    if wants_throughput:
        why = "objective utilization" if spec.objective == "utilization" else "long-chain reasoning"
        tolerates = "dapo" if name == "dapo" else "a staleness correction and bound"
        return "disaggregated", f"{why} with {tolerates}"
    return "colocated", "objective latency"


def resolve_weight_sync_method(spec: RLJobSpec, topology: ResolvedTopology) -> WeightSyncMethod:
    """``weightSync.method``, or its default: inProcess when colocated, http when disaggregated."""
    if spec.weight_sync.method is not None:
        return spec.weight_sync.method
    return "inProcess" if topology == "colocated" else "http"
