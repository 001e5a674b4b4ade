"""The RLJob API: pydantic models of the ``RLJob`` custom resource, ``rljob.io/v1beta1`` (the hub
and storage version) and ``rljob.io/v1alpha1`` (still served).

These models are the one source of truth for the resource: ``rljob_operator.crdgen`` generates the
CRD (structural schema, defaults, CEL rules, printer columns) from them, and the operator parses
every object it reads with ``parse_rljob``. Field descriptions become ``kubectl explain`` text.

Cross-field constraints are ``CelRule`` objects: each carries its CEL expression (emitted as an
``x-kubernetes-validations`` entry, checked by the API server) and a Python twin that reads the
same camelCase JSON (checked here), with one message naming the field path and the fix.

Pure: no kopf, no Kubernetes client, no environment, no clock.

The package is laid out by concern, each module importing only the ones below it (an
import-linter contract in ``pyproject.toml`` holds the order):

- ``rljob``: the whole object per served version, ``parse_rljob``, ``version_problems``;
- ``status``, ``topology``: the observed state; ``resolve_topology`` and what follows from it;
- ``spec``: ``RLJobSpec`` and ``RLJobSpecV1Alpha1``, and the rules across spec areas;
- ``rollout``, ``trainer``, ``lifecycle``: the role and lifecycle areas of the spec;
- ``algorithm``, ``model_task``, ``sync``, ``pods``, ``object_rules``: the other spec areas and
  the whole-object rules;
- ``cel``: ``CelRule`` and ``SpecModel``, the base of every spec model;
- ``errors``, ``versions``, ``fields``: error types and formatting, resource names and
  versions, shared field types.

This module re-exports the public names of all of them.
"""

from __future__ import annotations

from rljob_operator.api.algorithm import (
    DAPO_CLIP_RATIO_HIGH,
    ON_POLICY_ALGORITHMS,
    AdvantageEstimator,
    Algorithm,
    AlgorithmName,
    LossAggregation,
    OverlongBuffer,
    is_on_policy,
    resolve_advantage_estimator,
    resolve_clip_ratio_high,
    resolve_dynamic_sampling,
    resolve_loss_aggregation,
)
from rljob_operator.api.cel import (
    CelRule,
    JsonObject,
    SpecModel,
)
from rljob_operator.api.errors import (
    DUPLICATE_ERROR,
    RELATIVE_ERROR,
    RULE_ERROR,
    SpecError,
)
from rljob_operator.api.fields import (
    Quantity,
)
from rljob_operator.api.lifecycle import (
    DISRUPTION_REASONS,
    Checkpoint,
    Collapse,
    FailureAction,
    FailurePolicy,
    FailureReason,
    FailureRule,
    MLflowTracking,
    Scheduling,
    TensorBoardTracking,
    Tracking,
    WandbTracking,
)
from rljob_operator.api.model_task import (
    DATASET_MOUNT,
    EVAL_DATASET_MOUNT,
    BuiltinTask,
    Dataset,
    DatasetConfigMap,
    DatasetVolume,
    Eval,
    Model,
    ModelVolume,
    Reward,
    RewardTerm,
    Task,
)
from rljob_operator.api.object_rules import (
    NAME_MAX,
    OBJECT_RULES,
    ObjectRule,
    object_rule_problems,
)
from rljob_operator.api.pods import (
    OPERATOR_ENV,
    OPERATOR_ENV_PREFIXES,
    OPERATOR_LABEL_PREFIXES,
    OPERATOR_MOUNTS,
    OPERATOR_VOLUMES,
    EnvVar,
    FreeObject,
    LocalObjectReference,
    PodTemplateOverrides,
    Resources,
    Toleration,
    WorkerPods,
)
from rljob_operator.api.rljob import (
    ROOT_MODELS,
    SPEC_MODELS,
    ObjectMeta,
    RLJob,
    RLJobV1Alpha1,
    parse_rljob,
    version_problems,
)
from rljob_operator.api.rollout import (
    Rollout,
    Sampling,
    engines_per_replica,
    tensor_parallel_size,
)
from rljob_operator.api.spec import (
    Objective,
    ResolvedTopology,
    RLJobSpec,
    RLJobSpecV1Alpha1,
    Topology,
    all_cel_rules,
    resolve_overlong,
    responses_per_prompt,
)
from rljob_operator.api.status import (
    BestCheckpointStatus,
    CheckpointStatus,
    CollapseStatus,
    Condition,
    EvalStatus,
    KueueEviction,
    KueueStatus,
    LogprobMismatchStatus,
    Phase,
    Restarts,
    RLJobStatus,
    RoleStatus,
    RoleUtilization,
    StatusModel,
)
from rljob_operator.api.sync import (
    Buffer,
    Degrade,
    DegradeAction,
    Staleness,
    StalenessCorrection,
    StalenessV1Alpha1,
    WeightSync,
    WeightSyncMethod,
)
from rljob_operator.api.topology import (
    resolve_topology,
    resolve_weight_sync_method,
)
from rljob_operator.api.trainer import (
    MICRO_BATCH_TOKENS,
    GradientCompression,
    Sharding,
    Trainer,
    default_sharding,
    processes_per_replica,
    resolve_sharding,
)
from rljob_operator.api.versions import (
    API_VERSION,
    CATEGORIES,
    GROUP,
    KIND,
    LIST_KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    V1ALPHA1,
    VERSION,
    VERSIONS,
)

__all__ = [
    "API_VERSION",
    "CATEGORIES",
    "DAPO_CLIP_RATIO_HIGH",
    "DATASET_MOUNT",
    "DISRUPTION_REASONS",
    "DUPLICATE_ERROR",
    "EVAL_DATASET_MOUNT",
    "GROUP",
    "KIND",
    "LIST_KIND",
    "MICRO_BATCH_TOKENS",
    "NAME_MAX",
    "OBJECT_RULES",
    "ON_POLICY_ALGORITHMS",
    "OPERATOR_ENV",
    "OPERATOR_ENV_PREFIXES",
    "OPERATOR_LABEL_PREFIXES",
    "OPERATOR_MOUNTS",
    "OPERATOR_VOLUMES",
    "PLURAL",
    "RELATIVE_ERROR",
    "ROOT_MODELS",
    "RULE_ERROR",
    "SHORT_NAMES",
    "SINGULAR",
    "SPEC_MODELS",
    "V1ALPHA1",
    "VERSION",
    "VERSIONS",
    "AdvantageEstimator",
    "Algorithm",
    "AlgorithmName",
    "BestCheckpointStatus",
    "Buffer",
    "BuiltinTask",
    "CelRule",
    "Checkpoint",
    "CheckpointStatus",
    "Collapse",
    "CollapseStatus",
    "Condition",
    "Dataset",
    "DatasetConfigMap",
    "DatasetVolume",
    "Degrade",
    "DegradeAction",
    "EnvVar",
    "Eval",
    "EvalStatus",
    "FailureAction",
    "FailurePolicy",
    "FailureReason",
    "FailureRule",
    "FreeObject",
    "GradientCompression",
    "JsonObject",
    "KueueEviction",
    "KueueStatus",
    "LocalObjectReference",
    "LogprobMismatchStatus",
    "LossAggregation",
    "MLflowTracking",
    "Model",
    "ModelVolume",
    "ObjectMeta",
    "ObjectRule",
    "Objective",
    "OverlongBuffer",
    "Phase",
    "PodTemplateOverrides",
    "Quantity",
    "RLJob",
    "RLJobSpec",
    "RLJobSpecV1Alpha1",
    "RLJobStatus",
    "RLJobV1Alpha1",
    "ResolvedTopology",
    "Resources",
    "Restarts",
    "Reward",
    "RewardTerm",
    "RoleStatus",
    "RoleUtilization",
    "Rollout",
    "Sampling",
    "Scheduling",
    "Sharding",
    "SpecError",
    "SpecModel",
    "Staleness",
    "StalenessCorrection",
    "StalenessV1Alpha1",
    "StatusModel",
    "Task",
    "TensorBoardTracking",
    "Toleration",
    "Topology",
    "Tracking",
    "Trainer",
    "WandbTracking",
    "WeightSync",
    "WeightSyncMethod",
    "WorkerPods",
    "all_cel_rules",
    "default_sharding",
    "engines_per_replica",
    "is_on_policy",
    "object_rule_problems",
    "parse_rljob",
    "processes_per_replica",
    "resolve_advantage_estimator",
    "resolve_clip_ratio_high",
    "resolve_dynamic_sampling",
    "resolve_loss_aggregation",
    "resolve_overlong",
    "resolve_sharding",
    "resolve_topology",
    "resolve_weight_sync_method",
    "responses_per_prompt",
    "tensor_parallel_size",
    "version_problems",
]
