"""Pure reconcile: (job, observed children, now) → plan.

All policy lives here: which children must exist, which pods go away (scale-down, suspend,
role-scoped restarts with backoff), the degrade rule, the elastic rollout policy, the lifecycle
(Succeeded at totalSteps, TTL) and the job's phase and conditions. No client, no clock: ``now`` and
the operator-wide knobs (``Policy``) are arguments; what must survive between passes lives in the
job's status.

Where each concern lives (one module each; they import only ``shared``, never each other):

- ``pass_``: ``reconcile()``, one pass as a short sequence of calls into the modules below;
- ``status``: the workers' reports (step, lag, checkpoints, exported model) into the status;
- ``phase``: phase and conditions, why a job waits, Succeeded, TTL, an invalid spec;
- ``admission``: Kueue (admitted or held, placement, the Workload) and suspend;
- ``failover``: what happens when a pod dies: role-scoped restarts, backoff, restart budget;
- ``control``: staleness and the degrade rule, the live control published to the workers;
- ``elasticity``: the built-in rollout autoscaler and its one-owner rule for ``/scale``;
- ``children``: desired vs observed children: what to apply, which pods go;
- ``shared``: ``Observed``, ``Plan``, ``Policy``, the pass's scratch state, small pod readers.
"""

from rljob_operator.reconcile.children import (
    GANG_UNAVAILABLE,
    QUEUE_IGNORED,
    RBAC_KINDS,
    SYNCED_KINDS,
    TOKEN_PLACEHOLDER,
)
from rljob_operator.reconcile.control import control_of
from rljob_operator.reconcile.elasticity import SCALE_REVERSAL_COOLDOWNS, external_scaler
from rljob_operator.reconcile.failover import Failure
from rljob_operator.reconcile.pass_ import reconcile
from rljob_operator.reconcile.phase import (
    CLAIM_PENDING_SECONDS,
    CLAIM_REASONS,
    CONDITION_TYPES,
    IMAGE_WAIT_REASONS,
    claim_problem,
    image_problem,
)
from rljob_operator.reconcile.shared import (
    FINISHED,
    POD_INPUTS,
    EventSpec,
    ObjectRef,
    Observed,
    Plan,
    Policy,
    Refusal,
    WorkloadPatch,
    child_digest,
    merge_patch_between,
    retry_delay,
)
from rljob_operator.reconcile.status import (
    CLOCK_SKEW_SECONDS,
    EPHEMERAL,
    EXPORTED_MODEL_MAX,
    build_utilization_status,
    checkpoint_step,
    exported_model_path,
    read_progress,
    sticky_topology,
)

__all__ = [
    "CLAIM_PENDING_SECONDS",
    "CLAIM_REASONS",
    "CLOCK_SKEW_SECONDS",
    "CONDITION_TYPES",
    "EPHEMERAL",
    "EXPORTED_MODEL_MAX",
    "FINISHED",
    "GANG_UNAVAILABLE",
    "IMAGE_WAIT_REASONS",
    "POD_INPUTS",
    "QUEUE_IGNORED",
    "RBAC_KINDS",
    "SCALE_REVERSAL_COOLDOWNS",
    "SYNCED_KINDS",
    "TOKEN_PLACEHOLDER",
    "EventSpec",
    "Failure",
    "ObjectRef",
    "Observed",
    "Plan",
    "Policy",
    "Refusal",
    "WorkloadPatch",
    "build_utilization_status",
    "checkpoint_step",
    "child_digest",
    "claim_problem",
    "control_of",
    "exported_model_path",
    "external_scaler",
    "image_problem",
    "merge_patch_between",
    "read_progress",
    "reconcile",
    "retry_delay",
    "sticky_topology",
]
