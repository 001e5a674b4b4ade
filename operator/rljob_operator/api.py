"""The RLJob API: pydantic models of the ``RLJob`` custom resource, ``rljob.io/v1beta1`` (the hub
and storage version) and ``rljob.io/v1alpha1`` (still served).

These models are the one source of truth for the resource: ``rljob_operator.crdgen`` generates the
CRD (structural schema, defaults, CEL rules, printer columns) from them, and the operator parses
every object it reads with ``parse_rljob``. Field descriptions become ``kubectl explain`` text.

Cross-field constraints are ``CelRule`` objects: each carries its CEL expression (emitted as an
``x-kubernetes-validations`` entry, checked by the API server) and a Python twin that reads the
same camelCase JSON (checked here), with one message naming the field path and the fix.

Pure: no kopf, no Kubernetes client, no environment, no clock.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final, Literal, Self, get_args, get_origin

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

GROUP: Final = "rljob.io"
VERSION: Final = "v1beta1"
"""The hub: the version the operator reads and writes, and the storage version."""
API_VERSION: Final = "rljob.io/v1beta1"
V1ALPHA1: Final = "v1alpha1"
"""The older version, still served; converted losslessly to and from the hub
(``rljob_operator.conversion``)."""
VERSIONS: Final = (V1ALPHA1, VERSION)
KIND: Final = "RLJob"
LIST_KIND: Final = "RLJobList"
PLURAL: Final = "rljobs"
SINGULAR: Final = "rljob"
SHORT_NAMES = ("rlj",)
CATEGORIES = ("all", "rl")

AlgorithmName = Literal["ppo", "grpo", "dapo"]
Topology = Literal["colocated", "disaggregated", "auto"]
ResolvedTopology = Literal["colocated", "disaggregated"]
Objective = Literal["latency", "utilization"]
AdvantageEstimator = Literal["gae", "grpo", "dr-grpo"]
StalenessCorrection = Literal["none", "decoupledPPO", "tis"]
WeightSyncMethod = Literal["inProcess", "file", "http", "nccl"]
Phase = Literal["Pending", "Running", "Degraded", "Restarting", "Suspended", "Succeeded", "Failed"]

ON_POLICY_ALGORITHMS: tuple[AlgorithmName, ...] = ("ppo", "grpo")
RULE_ERROR = "rljob_rule"
"""pydantic error type of a failed cross-field rule; its message already names the path."""
RELATIVE_ERROR = "rljob_relative"
"""pydantic error type whose messages name paths relative to the failing object (ctx: messages)."""
DUPLICATE_ERROR = "rljob_duplicate"
"""pydantic error type of a repeated list-map key (ctx: name, index)."""

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
_QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_GPU_RESOURCE = "nvidia.com/gpu"
_PATH_MAX = 1024
_NAME_MAX = 253
_LIST_MAX = 64


def _quantity(value: object) -> int | str:
    """Accept a Kubernetes quantity (``2``, ``"500m"``, ``"16Gi"``) as int or string."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.fullmatch(_QUANTITY, value):
        return value
    raise PydanticCustomError(
        "quantity", "must be a Kubernetes quantity such as 2, '500m' or '16Gi'"
    )


Quantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

JsonObject = Mapping[str, Any]


@dataclass(frozen=True)
class CelRule:
    """One cross-field constraint, enforced by the API server (CEL) and by pydantic (Python).

    ``holds`` is the Python twin of ``rule``: it reads the same camelCase JSON that CEL sees as
    ``self`` (defaults applied, unset optional fields absent). ``message`` names the field path
    and the fix; ``render``/``message_expression`` make it specific to the object when set.
    """

    rule: str
    message: str
    holds: Callable[[JsonObject], bool]
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueRequired", "FieldValueForbidden"] = (
        "FieldValueInvalid"
    )
    message_expression: str | None = None
    render: Callable[[JsonObject], str] | None = None

    def explain(self, obj: JsonObject) -> str:
        """The error message for ``obj``, which violates this rule."""
        return self.render(obj) if self.render else self.message

    def to_validation(self) -> dict[str, str]:
        """This rule as one ``x-kubernetes-validations`` entry."""
        entry = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.message_expression:
            entry["messageExpression"] = self.message_expression
        return entry


def _attach_cel_rules(schema: JsonDict, cls: type[Any]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        validations: list[JsonValue] = [dict(r.to_validation()) for r in rules]
        schema["x-kubernetes-validations"] = validations


class SpecModel(BaseModel):
    """Base of the spec models: camelCase aliases, unknown fields rejected, CEL rules enforced.

    A rule of a model that the CRD defaults to ``{}`` must hold on ``{}`` too (guard each field
    with ``has()``): the API server checks published defaults against the rules before it fills
    in their nested defaults.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # as the API server: "yes" is no boolean, "3" no integer
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        json_schema_extra=_attach_cel_rules,
    )
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _enforce_cel_rules(self) -> Self:
        if not self.cel_rules:
            return self
        view = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        failed = [rule.explain(view) for rule in self.cel_rules if not rule.holds(view)]
        if failed:
            raise PydanticCustomError(
                RULE_ERROR, "{message}", {"message": "\n".join(failed), "messages": failed}
            )
        return self


class StatusModel(BaseModel):
    """Base of the status models: camelCase aliases; unknown fields ignored (written by others)."""

    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )


def _nested(model: type[BaseModel], description: str) -> Any:
    """A defaulted nested object; ``default: {}`` in the CRD lets the server apply its defaults."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


def _uses_groups(algorithm: JsonObject) -> bool:
    """Whether advantages are group-relative (grpo, dr-grpo), i.e. need several samples a prompt."""
    estimator = algorithm.get("advantageEstimator")
    if estimator is not None:
        return bool(estimator != "gae")
    return bool(algorithm["name"] != "ppo")


_USES_GROUPS_CEL = (
    "(has(self.advantageEstimator) ? self.advantageEstimator != 'gae' : self.name != 'ppo')"
)
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
DAPO_CLIP_RATIO_HIGH = 0.28
"""DAPO's clip-higher ε_high (Yu et al., 2025), the default of algorithm dapo."""


def _overlong_on(algorithm: JsonObject) -> bool:
    """Whether overlong shaping applies: ``overlongBuffer.enabled``, else on for dapo."""
    enabled = algorithm["overlongBuffer"].get("enabled")
    return bool(enabled) if enabled is not None else algorithm["name"] == "dapo"


_OVERLONG_ON_CEL = (
    "(has(self.algorithm.overlongBuffer.enabled) ? self.algorithm.overlongBuffer.enabled "
    ": self.algorithm.name == 'dapo')"
)


# --------------------------------------------------------------------------------- algorithm


class OverlongBuffer(SpecModel):
    """DAPO soft overlong punishment: responses longer than maxLength - cacheLength tokens get a
    reward penalty that grows linearly to -1 at maxLength."""

    enabled: bool | None = Field(
        None,
        description="Apply the overlong penalty to the reward. Unset: on for dapo (the "
        "paper's default), off otherwise.",
    )
    max_length: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Length in tokens where the penalty reaches -1; never larger than "
        "spec.rollout.sampling.maxTokens. Unset: spec.rollout.sampling.maxTokens.",
    )
    cache_length: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="Width in tokens of the penalty ramp that ends at maxLength "
        "(DAPO's L_cache, e.g. 4096 of 20480). Must be smaller than maxLength. Unset: "
        "maxLength / 5, as in the paper.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.cacheLength) || !has(self.maxLength) || "
            "self.cacheLength < self.maxLength",
            message="spec.algorithm.overlongBuffer.cacheLength must be < "
            "spec.algorithm.overlongBuffer.maxLength (the penalty ramps over the last "
            "cacheLength tokens before maxLength); lower cacheLength or raise maxLength",
            holds=lambda o: (
                "cacheLength" not in o or "maxLength" not in o or o["cacheLength"] < o["maxLength"]
            ),
            field_path=".cacheLength",
        ),
    )


class Algorithm(SpecModel):
    """The RL algorithm and its hyper-parameters (names follow verl where they overlap)."""

    name: AlgorithmName = Field(
        description="ppo: actor-critic with GAE advantages (trains a value model). grpo: "
        "group-relative advantages, no critic. dapo: GRPO plus clip-higher, dynamic sampling, "
        "token-level loss and overlong shaping. ppo and grpo are on-policy and need a colocated "
        "topology unless spec.staleness sets a correction and a bound."
    )
    clip_ratio_low: float = Field(
        0.2, gt=0, lt=1, description="ε_low: the importance ratio is clipped below at 1 - ε_low."
    )
    clip_ratio_high: float | None = Field(
        None,
        gt=0,
        le=1,
        description="ε_high: the importance ratio is clipped above at 1 + ε_high. Must be >= "
        "clipRatioLow. Unset: 0.28 for dapo (clip-higher; at least clipRatioLow), "
        "clipRatioLow otherwise.",
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        le=100,
        description="Dual-clip constant c > 1 (e.g. 3.0): bounds the loss of negative-advantage "
        "tokens at c × advantage. Unset: no dual clip.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Weight of the KL penalty to the reference model; 0 disables it.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="KL estimator. k2 ((log-ratio)^2 / 2) and k3 (ratio - 1 - log-ratio, "
        "clamped at 10 per token) are added to the loss, where their gradients are those of "
        "KL(policy||reference) and KL(reference||policy). k1 (log-ratio) has a zero expected "
        "gradient in the loss, so with k1 the KL is a detached per-token reward penalty "
        "instead (klCoef × k1 subtracted from the reward).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor for GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (bias/variance trade-off).")
    group_size: int = Field(
        8,
        ge=1,
        le=1024,
        description="Responses sampled per prompt for group-relative advantages (grpo, dapo, "
        "or advantageEstimator grpo/dr-grpo); at least 2 there.",
    )
    advantage_estimator: AdvantageEstimator | None = Field(
        None,
        description="gae (needs the value model: ppo only), grpo (group-normalised: (r - mean) / "
        "std) or dr-grpo (group mean removed, no std division). Unset: gae for ppo, grpo for "
        "grpo and dapo.",
    )
    dynamic_sampling: bool | None = Field(
        None,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero "
        "advantage) and keep sampling until the batch is full. Unset: on for dapo, off "
        "otherwise.",
    )
    overlong_buffer: OverlongBuffer = _nested(
        OverlongBuffer, "DAPO overlong reward shaping for responses near the length limit."
    )
    loss_aggregation: LossAggregation | None = Field(
        None,
        description="How per-token losses become one number (counts taken over every trainer "
        "rank): token-mean (every token weighs the same; DAPO), seq-mean-token-mean (mean per "
        "sequence, then over sequences; original GRPO), seq-mean-token-sum (sum per sequence, "
        "then mean) or seq-mean-token-sum-norm (sum over tokens / (sequences × "
        "rollout.sampling.maxTokens), a constant; Dr. GRPO). Unset: seq-mean-token-sum-norm "
        "with advantageEstimator dr-grpo, token-mean otherwise.",
    )
    learning_rate: float = Field(1e-6, gt=0, le=1, description="Actor (policy) learning rate.")
    critic_learning_rate: float = Field(
        1e-5, gt=0, le=1, description="Value-model learning rate; used only with gae (ppo)."
    )
    batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Prompts per training step (before group sampling)."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Prompts per optimizer update; a step makes ppoEpochs × batchSize / "
        "miniBatchSize updates. Unset: batchSize (one update per epoch).",
    )
    ppo_epochs: int = Field(
        1, ge=1, le=100, description="Passes over each step's batch (PPO epochs)."
    )
    entropy_coef: float = Field(
        0.0, ge=0, le=10, description="Entropy bonus weight; 0 disables it."
    )
    max_grad_norm: float = Field(
        1.0, gt=0, le=1e6, description="Global gradient-norm clipping threshold."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.clipRatioHigh) || self.clipRatioHigh >= self.clipRatioLow",
            message="spec.algorithm.clipRatioHigh must be >= spec.algorithm.clipRatioLow "
            "(clip-higher only widens the upper bound); raise clipRatioHigh or lower clipRatioLow",
            holds=lambda a: "clipRatioHigh" not in a or a["clipRatioHigh"] >= a["clipRatioLow"],
            field_path=".clipRatioHigh",
        ),
        CelRule(
            rule=f"!{_USES_GROUPS_CEL} || self.groupSize >= 2",
            message="spec.algorithm.groupSize must be >= 2 for grpo and dapo (advantages are "
            "relative to the other responses to the same prompt); set groupSize to 2 or more, "
            "e.g. 8",
            holds=lambda a: not _uses_groups(a) or a["groupSize"] >= 2,
            field_path=".groupSize",
        ),
        CelRule(
            rule="!has(self.advantageEstimator) || self.advantageEstimator != 'gae' "
            "|| self.name == 'ppo'",
            message="spec.algorithm.advantageEstimator: gae needs a value model, which only ppo "
            "trains; remove advantageEstimator or set spec.algorithm.name to ppo",
            holds=lambda a: a.get("advantageEstimator") != "gae" or a["name"] == "ppo",
            field_path=".advantageEstimator",
        ),
        CelRule(
            rule="!has(self.miniBatchSize) || self.miniBatchSize <= self.batchSize",
            message="spec.algorithm.miniBatchSize must be <= spec.algorithm.batchSize (it splits "
            "one step's prompts into optimizer updates); lower miniBatchSize or remove it",
            holds=lambda a: a.get("miniBatchSize", 0) <= a["batchSize"],
            field_path=".miniBatchSize",
        ),
    )


# ------------------------------------------------------------------------------ model, task


class ModelVolume(SpecModel):
    """A PersistentVolumeClaim holding the model, mounted read-only into every pod."""

    claim_name: str = Field(
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="Name of the PersistentVolumeClaim (same namespace) that holds the model.",
    )
    mount_path: str = Field(
        "/models",
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Where the claim is mounted; spec.model.path should lie under it.",
    )


class Model(SpecModel):
    """The policy model to train. Nothing is downloaded at run time: the weights must already be
    on a volume the pods mount (spec.model.volume) or baked into the image."""

    path: str = Field(
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Absolute path, inside the pods, of a Hugging Face model directory "
        "(config.json + safetensors), e.g. /models/tiny-qwen2.",
    )
    tokenizer_path: str | None = Field(
        None,
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Absolute path of the tokenizer directory. Unset: spec.model.path.",
    )
    volume: ModelVolume | None = Field(
        None, description="PVC holding the model, mounted read-only. Unset: no volume is mounted."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Compute and rollout dtype. bfloat16: the trainer keeps fp32 master "
        "weights and optimizer state and computes in bf16; float32: fp32 throughout. float16 "
        "is refused (training it needs a gradient scaler, which the trainer does not have).",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.dtype) || self.dtype != 'float16'",
            message="spec.model.dtype: float16 training needs a gradient scaler, which the "
            "trainer does not have (fp16 AdamW underflows); use bfloat16 (the trainer keeps fp32 "
            "master weights and computes in bf16) or float32",
            holds=lambda m: m.get("dtype") != "float16",
            field_path=".dtype",
        ),
    )


class BuiltinTask(SpecModel):
    """A verifiable toy task generated locally by the workers (no dataset download)."""

    name: Literal["copy", "successor", "add-mod10"] = Field(
        description="copy: repeat the prompt. successor: the next character of each digit/letter. "
        "add-mod10: the sum of two digits modulo 10."
    )
    num_prompts: int = Field(256, ge=1, le=1_000_000, description="Prompts to generate.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the prompt generator.")


class Reward(SpecModel):
    """How a response is scored."""

    function: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_IMPORT_PATH,
        description="Import path 'module:function' of a reward function (prompt, response, "
        "answer) -> float, importable in the worker image. Unset: the built-in exact-match "
        "reward (1.0 when the response equals the answer, else 0.0).",
    )


class Task(SpecModel):
    """The prompts to train on and their reward: exactly one of builtin and datasetPath."""

    builtin: BuiltinTask | None = Field(None, description="A built-in toy task.")
    dataset_path: str | None = Field(
        None,
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Absolute path, inside the pods, of a JSONL file with one "
        '{"prompt": ..., "answer": ...} object per line.',
    )
    reward: Reward = _nested(Reward, "Reward function.")
    long_chain_reasoning: bool = Field(
        False,
        description="Responses are long chains of reasoning (long, variable generation time). "
        "With topology auto this favours disaggregated for dapo or staleness-corrected jobs.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.builtin) != has(self.datasetPath)",
            message="spec.task: set exactly one of spec.task.builtin and spec.task.datasetPath",
            holds=lambda t: ("builtin" in t) != ("datasetPath" in t),
        ),
    )


# ---------------------------------------------------------------------------- rollout, trainer


class Resources(SpecModel):
    """CPU/memory requests and limits per pod, as Kubernetes quantities. GPUs are set with
    gpusPerReplica, not here."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Minimum resources, e.g. {cpu: '4', memory: 32Gi}. cpu and memory default "
        "to 1 and 2Gi when neither requests nor limits set them, so pods are never BestEffort.",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Maximum resources, e.g. {memory: 48Gi}.",
    )


def _no_gpu_in_resources(role: str) -> CelRule:
    def holds(r: JsonObject) -> bool:
        res = r.get("resources", {})
        return all(_GPU_RESOURCE not in res.get(k, {}) for k in ("requests", "limits"))

    return CelRule(
        rule="!has(self.resources) || ("
        f"(!has(self.resources.requests) || !('{_GPU_RESOURCE}' in self.resources.requests)) && "
        f"(!has(self.resources.limits) || !('{_GPU_RESOURCE}' in self.resources.limits)))",
        message=f"spec.{role}.resources: do not set {_GPU_RESOURCE} here; "
        f"set spec.{role}.gpusPerReplica instead",
        holds=holds,
        field_path=".resources",
        reason="FieldValueForbidden",
    )


class Sampling(SpecModel):
    """Rollout sampling parameters (vLLM SamplingParams)."""

    # On the wire samplesPerPrompt, not vLLM's "n": YAML 1.1 parsers (kubectl's included) read
    # a bare `n:` key as the boolean false.
    n: int | None = Field(
        None,
        alias="samplesPerPrompt",
        ge=1,
        le=1024,
        description="Responses sampled per prompt (vLLM's n). Unset: spec.algorithm.groupSize "
        "for grpo/dapo, 1 for ppo. With group-relative advantages it must equal groupSize.",
    )
    max_tokens: int = Field(1024, ge=1, le=1_048_576, description="Maximum response length.")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling probability mass.")


class Toleration(SpecModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(None, max_length=317, description="Taint key; empty with Exists: all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match. Unset: all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="For NoExecute: how long the pod stays bound after the taint."
    )


FreeObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A core/v1 object passed through as written (a Volume, an EnvVar, an Affinity, ...); the API
server validates it when the operator creates the pod."""

OPERATOR_VOLUMES: Final = ("config", "tmp", "home", "dshm", "checkpoints", "model")
"""Volume names of the worker pods that the operator owns."""
OPERATOR_ENV_PREFIXES: Final = ("RLJOB_",)
OPERATOR_ENV: Final = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "POD_NAME",
    "POD_NAMESPACE",
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
)
"""Environment variables of the worker containers that the operator sets (plus RLJOB_*)."""
OPERATOR_LABEL_PREFIXES: Final = (f"{GROUP}/", "app.kubernetes.io/", "scheduling.x-k8s.io/")
OPERATOR_MOUNTS: Final = ("/etc/rljob", "/tmp", "/home/rljob", "/dev/shm")
"""Mount paths of the worker containers the operator owns (besides the checkpoint and model
mounts, which follow spec.checkpoint.path and spec.model.volume.mountPath)."""


class LocalObjectReference(SpecModel):
    """A reference by name to an object in the job's namespace (e.g. an image pull Secret)."""

    name: str = Field(max_length=_NAME_MAX, pattern=_DNS_SUBDOMAIN, description="Object name.")


class PodTemplateOverrides(SpecModel):
    """Pod-template fields added to every pod of one role, as Kubeflow Trainer's
    podTemplateOverrides and JobSet's pod templates allow: extra volumes and mounts (a dataset,
    a venv), env from a Secret, placement (affinity, tolerations, nodeSelector), pull Secrets.
    The operator merges them into the pods it builds; fields it owns (its volumes, mounts,
    environment variables and labels) are refused with the field path."""

    labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=64, description="Extra pod labels."
    )
    annotations: dict[str, Annotated[str, Field(max_length=32_768)]] = Field(
        default_factory=dict, max_length=64, description="Extra pod annotations."
    )
    volumes: list[FreeObject] = Field(
        default_factory=list, max_length=_LIST_MAX, description="Extra pod volumes (core/v1)."
    )
    volume_mounts: list[FreeObject] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra volumeMounts of the worker container (core/v1 VolumeMount).",
    )
    env: list[FreeObject] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra environment variables (core/v1 EnvVar: value or valueFrom, e.g. "
        "secretKeyRef), after spec.worker.env (on a repeated name these win).",
    )
    env_from: list[FreeObject] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra envFrom sources of the worker container (core/v1 EnvFromSource, "
        "e.g. secretRef).",
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels these pods require, added to spec.scheduling.nodeSelector.",
    )
    affinity: FreeObject | None = Field(None, description="Pod affinity (core/v1 Affinity).")
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Tolerations added to these pods (after spec.scheduling.tolerations).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=_LIST_MAX, description="Image pull Secrets."
    )

    @model_validator(mode="after")
    def _operator_fields_refused(self) -> Self:
        problems = self.problems()
        if problems:
            raise PydanticCustomError(
                RELATIVE_ERROR, "{message}", {"message": "; ".join(problems), "messages": problems}
            )
        return self

    def problems(self, mounts: tuple[str, ...] = ()) -> list[str]:
        """What clashes with the fields the operator owns (relative paths), with the fix."""
        out = []
        for key in self.labels:
            if key.startswith(OPERATOR_LABEL_PREFIXES):
                out.append(
                    f"labels.{key}: the operator sets labels under {key.split('/')[0]}/; "
                    "use another label key"
                )
        for i, volume in enumerate(self.volumes):
            name = volume.get("name")
            if not isinstance(name, str) or not name:
                out.append(f"volumes[{i}].name: required")
            elif name in OPERATOR_VOLUMES:
                out.append(f"volumes[{i}].name: {name} is a volume the operator owns; rename it")
        for i, mount in enumerate(self.volume_mounts):
            path = mount.get("mountPath")
            if not isinstance(path, str) or not path.startswith("/"):
                out.append(f"volumeMounts[{i}].mountPath: required, an absolute path")
            elif any(_under(path, owned) for owned in (*OPERATOR_MOUNTS, *mounts)):
                out.append(
                    f"volumeMounts[{i}].mountPath: {path} is where the operator mounts "
                    "its own volume; pick another path"
                )
        for i, var in enumerate(self.env):
            name = var.get("name")
            if not isinstance(name, str) or not name:
                out.append(f"env[{i}].name: required")
            elif name in OPERATOR_ENV or name.startswith(OPERATOR_ENV_PREFIXES):
                out.append(f"env[{i}].name: {name} is set by the operator; use another name")
        return out


def _under(path: str, owned: str) -> bool:
    """Whether mount path ``path`` is ``owned`` or lies inside it."""
    a, b = path.rstrip("/") or "/", owned.rstrip("/") or "/"
    return a == b or a.startswith(b + "/")


class Rollout(SpecModel):
    """Rollout (generation) engines. Disaggregated: one pod per replica, elastic between
    minReplicas and maxReplicas. Colocated: the engine runs inside each of the
    spec.trainer.replicas actor pods and replicas/minReplicas/maxReplicas are not used."""

    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm (fast, paged attention) or hf (transformers generate; reference)."
    )
    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Rollout pods (disaggregated). Target of the scale subresource "
        "(kubectl scale rljob/NAME --replicas=N); to pause use spec.suspend.",
    )
    min_replicas: int | None = Field(
        None, ge=1, le=1024, description="Lower bound for elastic scaling. Unset: no lower bound."
    )
    max_replicas: int | None = Field(
        None, ge=1, le=1024, description="Upper bound for elastic scaling. Unset: no upper bound."
    )
    gpus_per_replica: int = Field(
        1,
        ge=0,
        le=64,
        description="nvidia.com/gpu per rollout pod (tensor-parallel size); 0 = CPU.",
    )
    sampling: Sampling = _nested(Sampling, "Sampling parameters.")
    resources: Resources = _nested(Resources, "CPU/memory per rollout pod.")
    pod_template_overrides: PodTemplateOverrides = _nested(
        PodTemplateOverrides,
        "Extra pod-template fields of the rollout pods (volumes, env, placement, pull Secrets).",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.minReplicas) || self.minReplicas <= self.replicas",
            message="spec.rollout.minReplicas must be <= spec.rollout.replicas; lower minReplicas "
            "or raise replicas",
            holds=lambda r: "minReplicas" not in r or r["minReplicas"] <= r["replicas"],
            field_path=".minReplicas",
        ),
        CelRule(
            rule="!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            message="spec.rollout.replicas must be <= spec.rollout.maxReplicas; lower replicas "
            "or raise maxReplicas",
            holds=lambda r: "maxReplicas" not in r or r["replicas"] <= r["maxReplicas"],
            field_path=".replicas",
        ),
        _no_gpu_in_resources("rollout"),
    )


class GradientCompression(SpecModel):
    """Compression of the gradient reduction between trainer ranks: a DDP communication hook, or
    with sharding fsdp FSDP2's reduce dtype."""

    type: Literal["none", "fp16", "bf16", "powerSGD"] = Field(
        "none",
        description="none, fp16/bf16 (reduce in 16 bits, halves traffic; with sharding fsdp "
        "FSDP2's reduce dtype) or powerSGD (low-rank, needs rank; sharding ddp only). Worth it "
        "across nodes, i.e. mostly disaggregated.",
    )
    rank: int | None = Field(
        None, ge=1, le=1024, description="PowerSGD matrix rank (e.g. 4); required for powerSGD."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.type) || self.type != 'powerSGD' || has(self.rank)",
            message="spec.trainer.gradientCompression.rank: powerSGD needs rank >= 1 (e.g. 4); "
            "set rank or pick type none, fp16 or bf16",
            holds=lambda g: g.get("type") != "powerSGD" or g.get("rank", 0) >= 1,
            field_path=".rank",
            reason="FieldValueRequired",
        ),
    )


Sharding = Literal["fsdp", "ddp"]
MICRO_BATCH_TOKENS = 16384
"""Default token budget of one trainer forward/backward (spec.trainer.microBatchTokens)."""


def _powersgd(t: JsonObject) -> bool:
    return bool(t.get("gradientCompression", {}).get("type") == "powerSGD")


def _sharding_of(t: JsonObject) -> str:
    """``resolve_sharding`` on the camelCase JSON the CEL rules see."""
    sharding = t.get("sharding")
    if sharding is not None:
        return str(sharding)
    return default_sharding(t.get("gradientCompression", {}).get("type", "none"))


_POWERSGD_CEL = (
    "(has(self.gradientCompression) && has(self.gradientCompression.type) && "
    "self.gradientCompression.type == 'powerSGD')"
)
_SHARDING_CEL = f"(has(self.sharding) ? self.sharding : ({_POWERSGD_CEL} ? 'ddp' : 'fsdp'))"


class Trainer(SpecModel):
    """Trainer pods: data parallel, sharded (FSDP2) or replicated (DDP). Colocated: the actor
    pods, each running engine and trainer."""

    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer pods (data-parallel world size). Colocated: the actor group size.",
    )
    gpus_per_replica: int = Field(
        1, ge=0, le=64, description="nvidia.com/gpu per trainer pod; 0 = CPU (gloo)."
    )
    resources: Resources = _nested(Resources, "CPU/memory per trainer pod.")
    pod_template_overrides: PodTemplateOverrides = _nested(
        PodTemplateOverrides,
        "Extra pod-template fields of the trainer pods (colocated: the actor pods): volumes, "
        "env, placement, pull Secrets.",
    )
    gradient_compression: GradientCompression = _nested(
        GradientCompression, "Gradient all-reduce compression."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: less memory, ~30% more compute. "
        "Recommended on GPUs with less than 80 GB.",
    )
    sharding: Sharding | None = Field(
        None,
        description="fsdp: FSDP2 shards parameters, gradients and AdamW state over all trainer "
        "ranks (per decoder layer, then the root), so per-rank memory falls with the rank "
        "count. ddp: every rank keeps a full replica of all three (the only mode of earlier "
        "releases; needed for gradientCompression powerSGD). Unset: ddp with "
        "gradientCompression.type powerSGD, fsdp otherwise.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp only: free the gathered parameters after the forward pass and gather "
        "them again for backward (ZeRO-3). false keeps them until backward (ZeRO-2): more "
        "memory, less communication. Ignored with ddp.",
    )
    cpu_offload: bool = Field(
        False,
        description="fsdp only: keep the sharded parameters, gradients and AdamW state in host "
        "memory (FSDP2's CPU offload policy; the optimizer step runs on the CPU), to fit a large "
        "model on few GPUs at the cost of speed. Applies to a single trainer rank too (FSDP2 "
        "over a group of one), so one GPU can train a model whose fp32 state it cannot hold.",
    )
    micro_batch_tokens: int = Field(
        MICRO_BATCH_TOKENS,
        ge=64,
        le=10_000_000,
        description="Token budget (prompt + response) of one forward/backward: each minibatch is "
        "split into micro-batches packed by length and gradients accumulate across them; the "
        "loss normalisation is that of the whole minibatch. Lower it when activations or "
        "logits do not fit.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        _no_gpu_in_resources("trainer"),
        CelRule(
            rule=f"!has(self.sharding) || self.sharding != 'fsdp' || !{_POWERSGD_CEL}",
            message="spec.trainer.gradientCompression.type: powerSGD is a DDP communication hook; "
            "with spec.trainer.sharding fsdp use none, fp16 or bf16 (FSDP2's reduce dtype), or "
            "set spec.trainer.sharding: ddp (or leave it unset: ddp with powerSGD)",
            holds=lambda t: t.get("sharding") != "fsdp" or not _powersgd(t),
            field_path=".gradientCompression.type",
        ),
        CelRule(
            rule=f"!has(self.cpuOffload) || !self.cpuOffload || {_SHARDING_CEL} != 'ddp'",
            message="spec.trainer.cpuOffload: CPU offload is an FSDP2 policy; with "
            "spec.trainer.sharding ddp (set, or unset with gradientCompression.type powerSGD) "
            "every rank keeps a full replica on its device, so remove cpuOffload, or set "
            "spec.trainer.sharding: fsdp with gradientCompression.type none, fp16 or bf16",
            holds=lambda t: not t.get("cpuOffload", False) or _sharding_of(t) != "ddp",
            field_path=".cpuOffload",
        ),
    )


# ------------------------------------------------------------------ staleness, buffer, sync


class Staleness(SpecModel):
    """How stale the data a trainer consumes may be."""

    max_versions: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Drop trajectories generated by a policy more than this many versions "
        "behind the trainer. Required (with correction) for ppo/grpo on disaggregated.",
    )
    max_age_seconds: float | None = Field(
        None,
        gt=0,
        le=604_800,
        description="Drop trajectories older than this when the trainer consumes them. "
        "Unset: only spec.buffer.maxAgeSeconds applies.",
    )
    correction: StalenessCorrection = Field(
        "none",
        description="Off-policy correction for stale samples: none, decoupledPPO (clip "
        "against a proximal policy, weight by behaviour ratio) or tis (truncated importance "
        "sampling).",
    )


DegradeAction = Literal["throttleRollouts", "tightenStaleness", "pauseRollouts"]
_LAG_THRESHOLD_TEXT = (
    "50 ms suits colocated jobs; disaggregated jobs lag by seconds and need a larger value, "
    "e.g. 10000."
)
_DEGRADE_ACTION_TEXT = (
    "throttleRollouts (fewer rollout replicas, down to minReplicas), tightenStaleness (halve "
    "maxVersions/maxAgeSeconds) or pauseRollouts (until the trainer catches up)."
)


class Degrade(SpecModel):
    """The policy-lag degrade rule (v1beta1; v1alpha1 kept these fields in spec.staleness)."""

    max_policy_lag_ms: float = Field(
        50.0,
        ge=0,
        le=86_400_000,
        description="Policy-lag alert threshold (ms). When status.policyLagMs stays above it for "
        "afterSeconds the job turns Degraded and action applies. " + _LAG_THRESHOLD_TEXT,
    )
    after_seconds: float = Field(
        30.0, ge=0, le=86_400, description="How long the lag must stay above the threshold."
    )
    action: DegradeAction = Field("throttleRollouts", description=_DEGRADE_ACTION_TEXT)


class StalenessV1Alpha1(Staleness):
    """How stale the data a trainer consumes may be, and what happens when policy lag grows."""

    max_policy_lag_ms: float = Field(
        50.0,
        ge=0,
        le=86_400_000,
        description="Policy-lag alert threshold (ms). When status.policyLagMs stays above it for "
        "degradeAfterSeconds the job turns Degraded and degradeAction applies. "
        + _LAG_THRESHOLD_TEXT,
    )
    degrade_after_seconds: float = Field(
        30.0, ge=0, le=86_400, description="How long the lag must stay above the threshold."
    )
    degrade_action: DegradeAction = Field("throttleRollouts", description=_DEGRADE_ACTION_TEXT)


class Buffer(SpecModel):
    """Experience buffer between rollouts and trainers (disaggregated)."""

    capacity: int = Field(
        4096, ge=1, le=10_000_000, description="Trajectories held; the oldest go first when full."
    )
    max_age_seconds: float = Field(
        7200.0,
        gt=0,
        le=604_800,
        description="Expiry: trajectories older than this are discarded so stale data never "
        "piles up (field guide: 2 hours).",
    )


class WeightSync(SpecModel):
    """How new policy weights reach the rollout engines."""

    method: WeightSyncMethod | None = Field(
        None,
        description="inProcess (colocated only), file (shared volume), http (trainer serves "
        "versioned weights) or nccl (GPU broadcast). Unset: inProcess when colocated, http when "
        "disaggregated.",
    )
    compression: Literal["none", "bf16", "fp8"] = Field(
        "none", description="Compress weights in transit (disaggregated): none, bf16 or fp8."
    )
    bucket_mib: int = Field(
        256,
        alias="bucketMiB",
        ge=1,
        le=16384,
        description="Weights are gathered from the trainer's shards and streamed to the rollout "
        "engines in buckets of this many MiB, so no rank holds the whole model at once: the "
        "sender's extra memory is about one bucket plus the largest tensor.",
    )


class Checkpoint(SpecModel):
    """Trainer checkpoints; a restarted, resumed or re-admitted job continues from the newest one.

    They live on a PersistentVolumeClaim, so they outlive the pods: spec.checkpoint.claimName
    (a claim you manage), else a per-job claim ``<name>-checkpoints`` the operator creates and
    the job owns (deleted with it), sized by size and storageClassName."""

    claim_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="An existing PersistentVolumeClaim (same namespace) for checkpoints; the "
        "operator mounts it and never deletes it. Unset: the operator creates the claim "
        "<name>-checkpoints (size, storageClassName, accessMode), owned by the job and deleted "
        "with it. It must be shared by every trainer pod (ReadWriteMany across nodes).",
    )
    size: Quantity = Field(
        "10Gi", description="Storage requested by the per-job claim (claimName unset)."
    )
    storage_class_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="StorageClass of the per-job claim. Unset: the cluster's default class.",
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = Field(
        "ReadWriteOnce",
        description="Access mode of the per-job claim: ReadWriteOnce while all trainer pods "
        "share a node; ReadWriteMany when they span nodes.",
    )
    ephemeral: bool = Field(
        False,
        description="Keep checkpoints in an emptyDir instead of a claim: they are deleted with "
        "the pod, so a restarted or resumed trainer group starts again from step 0 (a Warning "
        "Event says so). For throwaway runs only.",
    )
    path: str = Field(
        "/checkpoints", max_length=_PATH_MAX, pattern=r"^/", description="Mount path in the pods."
    )
    every_steps: int = Field(50, ge=1, le=1_000_000, description="Checkpoint every N steps.")
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept; older ones are deleted.")

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.claimName) || !has(self.ephemeral) || !self.ephemeral",
            message="spec.checkpoint: claimName and ephemeral: true exclude each other; keep "
            "claimName (checkpoints that outlive the pods) or remove it",
            holds=lambda c: "claimName" not in c or not c.get("ephemeral", False),
            field_path=".ephemeral",
        ),
    )


FailureReason = Literal["NodeLost", "Evicted", "DisruptionTarget", "OOMKilled", "Error"]
FailureAction = Literal["Ignore", "RestartRole", "FailJob"]
DISRUPTION_REASONS: tuple[FailureReason, ...] = ("NodeLost", "Evicted", "DisruptionTarget")
"""Failures the cluster caused, not the job: replaced without counting unless a rule says else."""


class FailureRule(SpecModel):
    """What to do when a pod fails in a given way (in the spirit of JobSet's
    failurePolicy.rules). A rule matches when every condition it sets matches; the first matching
    rule wins."""

    action: FailureAction = Field(
        description="Ignore: replace the pod (a trainer or actor: its group) without counting "
        "the restart against maxRestarts and without backoff. RestartRole: replace it and count "
        "the restart (the default for a failure no rule matches). FailJob: fail the job at once."
    )
    on_reasons: list[FailureReason] = Field(
        default_factory=list,
        max_length=5,
        description="Match these failure reasons: NodeLost (the pod's node is NotReady or "
        "gone), Evicted (kubelet eviction), DisruptionTarget (preemption, taint eviction, API "
        "eviction), OOMKilled, Error (the container exited non-zero). Empty: any reason.",
    )
    on_exit_codes: list[Annotated[int, Field(ge=0, le=255)]] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Match these container exit codes (e.g. 137). Empty: any exit code.",
    )
    roles: list[Literal["rollout", "trainer", "actor"]] = Field(
        default_factory=list,
        max_length=3,
        description="Match pods of these roles (rollout, trainer, actor). Empty: every role.",
    )


class FailurePolicy(SpecModel):
    """Restarts after pod failures: a budget per role, exponential backoff, and rules by failure
    reason or exit code. By default node loss, eviction and preemption (DisruptionTarget) replace
    pods without spending the budget; every other failure spends one restart of its role."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Counted restarts allowed per role (rollout; trainer or actor) before the "
        "job is Failed; 0 fails at the first counted one. A rollout pod is replaced alone, so "
        "each failed rollout pod counts once; a trainer (actor) group restart counts once.",
    )
    backoff_seconds: float = Field(
        10.0, ge=0, le=86_400, description="Delay before the first restart; doubles each time."
    )
    max_backoff_seconds: float = Field(
        300.0, ge=0, le=86_400, description="Upper bound of the restart delay."
    )
    rules: list[FailureRule] = Field(
        default_factory=list,
        max_length=16,
        description="Rules by failure reason, exit code and role → Ignore, RestartRole or "
        "FailJob; the first match wins. Without a match: NodeLost, Evicted and "
        "DisruptionTarget are ignored (not counted), anything else is RestartRole.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.backoffSeconds) || !has(self.maxBackoffSeconds) || "
            "self.backoffSeconds <= self.maxBackoffSeconds",
            message="spec.failurePolicy.backoffSeconds must be <= "
            "spec.failurePolicy.maxBackoffSeconds; lower backoffSeconds or raise "
            "maxBackoffSeconds",
            holds=lambda f: (
                "backoffSeconds" not in f
                or "maxBackoffSeconds" not in f
                or f["backoffSeconds"] <= f["maxBackoffSeconds"]
            ),
            field_path=".backoffSeconds",
        ),
    )


class Scheduling(SpecModel):
    """Placement and batch-scheduler interop (Kueue, Volcano, scheduler-plugins)."""

    scheduler_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="Scheduler for all pods, e.g. volcano. Unset: the default scheduler.",
    )
    priority_class_name: str | None = Field(
        None, max_length=_NAME_MAX, pattern=_DNS_SUBDOMAIN, description="PriorityClass of the pods."
    )
    gang: bool = Field(
        False,
        description="Schedule all pods of the job together or none (a PodGroup for Volcano / "
        "scheduler-plugins coscheduling).",
    )
    queue: str | None = Field(
        None,
        max_length=63,
        pattern=_DNS_LABEL,
        description="Volcano queue of the job's PodGroup (with gang: true and schedulerName "
        "volcano). Kueue is separate: put the label kueue.x-k8s.io/queue-name=<LocalQueue> on "
        "the RLJob and the operator queues it as a Kueue Workload.",
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Node labels the pods require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Tolerations added to every pod. Pods that request GPUs also tolerate the "
        "nvidia.com/gpu taint (NoSchedule) that GPU node pools usually carry.",
    )


class EnvVar(SpecModel):
    """An environment variable for the worker containers."""

    name: str = Field(
        min_length=1,
        max_length=_NAME_MAX,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name.",
    )
    value: str = Field("", max_length=32_768, description="Variable value.")


# ------------------------------------------------------------------------------------ spec


def _on_policy_bounded(s: JsonObject) -> bool:
    staleness = s["staleness"]
    return bool(staleness["correction"] != "none" and "maxVersions" in staleness)


_ON_POLICY_FIX = (
    " is on-policy; with topology disaggregated set spec.staleness.correction "
    "(decoupledPPO|tis) and spec.staleness.maxVersions"
)


class WorkerPods(SpecModel):
    """Settings every worker pod shares: image, environment, account, shutdown, /dev/shm."""

    image: str | None = Field(
        None,
        max_length=512,
        description="Worker container image. Unset: the image the operator was installed with.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the worker containers."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra environment variables for every worker container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    termination_grace_period_seconds: int = Field(
        30,
        ge=0,
        le=86_400,
        description="Seconds a worker gets between SIGTERM and SIGKILL when its pod is deleted "
        "(restarts, scale-down, suspend); forced deletion happens only when the node is gone.",
    )
    shm_size: Quantity = Field(
        "1Gi",
        description="Size limit of /dev/shm (memory-backed; counts against the pod's memory), "
        "e.g. 8Gi for NCCL and data loaders on GPU nodes.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="ServiceAccount of the worker pods. Unset: <name>-worker, which the "
        "operator creates. Either way the operator binds it to a Role that lets the workers "
        "report progress (get/patch of the job's progress ConfigMap); a set account must exist.",
    )

    @field_validator("env")
    @classmethod
    def _unique_env_names(cls, env: list[EnvVar]) -> list[EnvVar]:
        seen: set[str] = set()
        for i, var in enumerate(env):
            if var.name in seen:
                raise PydanticCustomError(
                    DUPLICATE_ERROR,
                    "{name} is set twice; keep one entry",
                    {"name": var.name, "index": i},
                )
            seen.add(var.name)
        return env


class _SpecCommon(SpecModel):
    """The spec fields both API versions share (same names, same places)."""

    algorithm: Algorithm = Field(description="RL algorithm and hyper-parameters.")
    topology: Topology = Field(
        "auto",
        description="colocated: N actor pods, each alternating generate → train → reload in one "
        "process (policy lag ~0). disaggregated: rollout pods and trainer pods run concurrently "
        "(lag of seconds, elastic rollouts). auto: chosen from the algorithm, staleness, "
        "objective and task; the result is in status.resolvedTopology.",
    )
    objective: Objective = Field(
        "latency",
        description="What topology auto optimises: latency (policy freshness: colocated) or "
        "utilization (GPU busy time: disaggregated when the algorithm tolerates stale data).",
    )
    model: Model = Field(description="The policy model.")
    task: Task = Field(description="Prompts and reward.")
    rollout: Rollout = _nested(Rollout, "Rollout engines.")
    trainer: Trainer = _nested(Trainer, "Trainers.")
    staleness: Staleness = _nested(
        Staleness,
        "How old the data a trainer learns from may be: version bound, off-policy correction, "
        "rollout hold (the policy-lag degrade rule is spec.degrade).",
    )
    buffer: Buffer = _nested(Buffer, "Experience buffer.")
    weight_sync: WeightSync = _nested(WeightSync, "Weight synchronisation trainer → rollouts.")
    checkpoint: Checkpoint = _nested(Checkpoint, "Checkpointing.")
    failure_policy: FailurePolicy = _nested(FailurePolicy, "Restart policy.")
    suspend: bool = Field(
        False,
        description="Delete the job's pods and keep the object (checkpoints stay); set back to "
        "false to resume. Under Kueue (label kueue.x-k8s.io/queue-name) it also deactivates the "
        "job's Workload, which releases its quota; pods otherwise wait for Kueue's admission.",
    )
    managed_by: str | None = Field(
        None,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="The controller that reconciles this job, as <domain>/<name> (JobSet and "
        "Kubeflow Trainer have the same field). Unset or rljob.io/rljob-operator: this "
        "operator. Any other value (e.g. kueue.x-k8s.io/multikueue) makes this operator leave "
        "the job alone: no pods, no Workload, no status writes. Immutable.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        le=31_536_000,
        description="Delete the RLJob this many seconds after it Succeeded or Failed. Unset: "
        "keep it.",
    )
    scheduling: Scheduling = _nested(Scheduling, "Scheduling and queueing.")
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Training steps to run.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Random seed for sampling and training.")

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!(self.topology == 'disaggregated' && self.algorithm.name in ['ppo', 'grpo']) "
            "|| (self.staleness.correction != 'none' && has(self.staleness.maxVersions))",
            message="spec.algorithm: ppo and grpo are on-policy; with topology disaggregated "
            "set spec.staleness.correction (decoupledPPO|tis) and spec.staleness.maxVersions",
            message_expression=f"'spec.algorithm: ' + self.algorithm.name + '{_ON_POLICY_FIX}'",
            holds=lambda s: (
                not (
                    s["topology"] == "disaggregated"
                    and s["algorithm"]["name"] in ON_POLICY_ALGORITHMS
                )
                or _on_policy_bounded(s)
            ),
            render=lambda s: f"spec.algorithm: {s['algorithm']['name']}{_ON_POLICY_FIX}",
            field_path=".staleness",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="!has(self.rollout.sampling.samplesPerPrompt) || "
            f"!{_USES_GROUPS_CEL.replace('self.', 'self.algorithm.')} || "
            "self.rollout.sampling.samplesPerPrompt == self.algorithm.groupSize",
            message="spec.rollout.sampling.samplesPerPrompt must equal spec.algorithm.groupSize "
            "with group-relative advantages (grpo, dapo); remove samplesPerPrompt or set it to "
            "groupSize",
            holds=lambda s: (
                "samplesPerPrompt" not in s["rollout"]["sampling"]
                or not _uses_groups(s["algorithm"])
                or s["rollout"]["sampling"]["samplesPerPrompt"] == s["algorithm"]["groupSize"]
            ),
            field_path=".rollout.sampling.samplesPerPrompt",
        ),
        CelRule(
            rule="!has(self.weightSync.method) || self.weightSync.method != 'inProcess' "
            "|| self.topology == 'colocated'",
            message="spec.weightSync.method: inProcess needs spec.topology colocated (engine and "
            "trainer share a process); set spec.topology colocated or use file, http or nccl",
            holds=lambda s: (
                s["weightSync"].get("method") != "inProcess" or s["topology"] == "colocated"
            ),
            field_path=".weightSync.method",
        ),
        CelRule(
            rule="!has(self.algorithm.overlongBuffer.maxLength) || "
            f"!{_OVERLONG_ON_CEL} || "
            "self.algorithm.overlongBuffer.maxLength <= self.rollout.sampling.maxTokens",
            message="spec.algorithm.overlongBuffer.maxLength must be <= "
            "spec.rollout.sampling.maxTokens (responses stop at maxTokens, so a longer limit "
            "never penalises anything); set maxLength to maxTokens or remove it",
            holds=lambda s: (
                "maxLength" not in s["algorithm"]["overlongBuffer"]
                or not _overlong_on(s["algorithm"])
                or s["algorithm"]["overlongBuffer"]["maxLength"]
                <= s["rollout"]["sampling"]["maxTokens"]
            ),
            field_path=".algorithm.overlongBuffer.maxLength",
        ),
        CelRule(
            rule="!has(self.algorithm.overlongBuffer.cacheLength) || "
            "has(self.algorithm.overlongBuffer.maxLength) || "
            "self.algorithm.overlongBuffer.cacheLength < self.rollout.sampling.maxTokens",
            message="spec.algorithm.overlongBuffer.cacheLength must be < "
            "spec.rollout.sampling.maxTokens (maxLength defaults to maxTokens); lower "
            "cacheLength or set maxLength",
            holds=lambda s: (
                "cacheLength" not in s["algorithm"]["overlongBuffer"]
                or "maxLength" in s["algorithm"]["overlongBuffer"]
                or s["algorithm"]["overlongBuffer"]["cacheLength"]
                < s["rollout"]["sampling"]["maxTokens"]
            ),
            field_path=".algorithm.overlongBuffer.cacheLength",
        ),
    )

    @model_validator(mode="after")
    def _overrides_keep_off_owned_mounts(self) -> Self:
        owned = [("spec.checkpoint.path", self.checkpoint.path)]
        if self.model.volume:
            owned.append(("spec.model.volume.mountPath", self.model.volume.mount_path))
        problems = []
        for role in ("rollout", "trainer"):
            overrides: PodTemplateOverrides = getattr(self, role).pod_template_overrides
            for i, mount in enumerate(overrides.volume_mounts):
                path = str(mount.get("mountPath", ""))
                for field, at in owned:
                    if _under(path, at) or _under(at, path):
                        problems.append(
                            f"spec.{role}.podTemplateOverrides.volumeMounts[{i}].mountPath: "
                            f"{path} overlaps {field} ({at}); pick another path"
                        )
        if problems:
            raise PydanticCustomError(
                RULE_ERROR, "{message}", {"message": "\n".join(problems), "messages": problems}
            )
        return self


class RLJobSpecV1Alpha1(_SpecCommon, WorkerPods):
    """Desired state of an RL post-training job (rljob.io/v1alpha1: the worker pod settings sit
    at the top of the spec and the degrade rule in spec.staleness)."""

    staleness: StalenessV1Alpha1 = _nested(
        StalenessV1Alpha1, "Staleness bounds and policy-lag degrade rule."
    )


class RLJobSpec(_SpecCommon):
    """Desired state of an RL post-training job."""

    worker: WorkerPods = _nested(
        WorkerPods,
        "Settings of every worker pod (image, env, ServiceAccount, grace period, /dev/shm).",
    )
    degrade: Degrade = _nested(
        Degrade, "Policy-lag degrade rule: threshold, how long, and what to do."
    )


# ---------------------------------------------------------------------------------- status


class Condition(StatusModel):
    """A status condition (the metav1.Condition shape)."""

    type: str = Field(
        max_length=316,
        description="Created, Running, Degraded, Restarting, Suspended, Succeeded or Failed.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1, max_length=1024, description="CamelCase reason for the last transition."
    )
    message: str = Field("", max_length=32_768, description="Human-readable details.")
    last_transition_time: AwareDatetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from."
    )


class RoleStatus(StatusModel):
    """Ready and desired pods of one role."""

    ready: int = Field(0, ge=0, description="Pods running and ready.")
    desired: int = Field(0, ge=0, description="Pods the operator wants.")


class Restarts(StatusModel):
    """Restarts so far, per role (colocated actors count as trainer)."""

    rollout: int = Field(0, ge=0, description="Rollout pod restarts.")
    trainer: int = Field(0, ge=0, description="Trainer (or actor) pod restarts.")


class CheckpointStatus(StatusModel):
    """The newest complete checkpoint."""

    step: int = Field(ge=0, description="Training step of the checkpoint.")
    path: str = Field(max_length=_PATH_MAX, description="Checkpoint directory in the pods.")
    time: AwareDatetime | None = Field(None, description="When it was written.")


class KueueEviction(StatusModel):
    """Why Kueue last took the job's quota away."""

    reason: str = Field(max_length=128, description="Kueue's reason, e.g. Preempted.")
    message: str = Field("", max_length=4096, description="Kueue's message.")
    time: AwareDatetime | None = Field(None, description="When Kueue evicted the workload.")
    checkpoint: str | None = Field(
        None, max_length=_PATH_MAX, description="Checkpoint kept for the resume."
    )


class KueueStatus(StatusModel):
    """The job's Kueue Workload (only with the label kueue.x-k8s.io/queue-name)."""

    workload: str | None = Field(None, max_length=253, description="The Workload's name.")
    local_queue: str | None = Field(None, max_length=63, description="LocalQueue it waits in.")
    cluster_queue: str | None = Field(
        None, max_length=253, description="ClusterQueue behind the LocalQueue."
    )
    admitted: bool = Field(False, description="Kueue admitted it: the pods may run.")
    admitted_counts: dict[str, int] = Field(
        default_factory=dict, description="Pods per role Kueue admitted (pod set → count)."
    )
    flavors: dict[str, str] = Field(
        default_factory=dict,
        description="ResourceFlavor(s) per role, comma-separated, as admitted.",
    )
    evictions: int = Field(0, ge=0, description="How often Kueue evicted the job so far.")
    last_eviction: KueueEviction | None = Field(None, description="The latest eviction.")


class RoleUtilization(StatusModel):
    """Utilisation of one role, averaged over its processes' last reports."""

    idle_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of wall time the role waited (for experience, weights or the "
        "other phase) over its last step.",
    )
    accelerator_utilization: float | None = Field(
        None, ge=0, le=100, description="Mean GPU utilisation (%, NVML); absent without GPUs."
    )
    accelerator_utilization_stddev: float | None = Field(
        None, ge=0, description="Fluctuation of GPU utilisation over the last step (%)."
    )


class RLJobStatus(StatusModel):
    """Observed state, written by the operator."""

    phase: Phase = Field(
        "Pending",
        description="Pending, Running, Degraded (lag above threshold), Restarting, Suspended, "
        "Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Latest observations, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the operator last acted on."
    )
    resolved_topology: ResolvedTopology | None = Field(
        None, description="The topology in use (spec.topology with auto resolved)."
    )
    rollout: RoleStatus = Field(
        default_factory=RoleStatus, description="Rollout pods (colocated: actor pods)."
    )
    trainer: RoleStatus = Field(
        default_factory=RoleStatus, description="Trainer pods (colocated: actor pods)."
    )
    rollout_replicas: int | None = Field(
        None, ge=0, description="Rollout pods that exist (scale subresource status replicas)."
    )
    rollout_selector: str | None = Field(
        None,
        max_length=1024,
        description="Label selector of the rollout pods (scale subresource, used by HPA).",
    )
    rollout_ready_text: str | None = Field(
        None, max_length=32, description="Ready/desired rollout pods as text, e.g. 2/3."
    )
    policy_version: int | None = Field(
        None, ge=0, description="Newest policy version published by the trainer."
    )
    step: int | None = Field(None, ge=0, description="Training steps completed.")
    policy_lag_ms: float | None = Field(
        None, ge=0, description="Policy lag in ms: age of the weights the rollouts sample with."
    )
    buffer_age_seconds: float | None = Field(
        None, ge=0, description="Age of the oldest trajectory in the experience buffer."
    )
    restarts: Restarts = Field(default_factory=Restarts, description="Restarts per role.")
    last_checkpoint: CheckpointStatus | None = Field(None, description="Newest checkpoint.")
    exported_model: str | None = Field(
        None,
        max_length=_PATH_MAX,
        description="The Hugging Face model directory (config, safetensors shards, tokenizer) "
        "written when the job succeeded, on the checkpoint volume under spec.checkpoint.path; "
        "load it with AutoModelForCausalLM.from_pretrained or vLLM. Unset with "
        "spec.checkpoint.ephemeral (deleted with the pods).",
    )
    start_time: AwareDatetime | None = Field(None, description="When the job started running.")
    completion_time: AwareDatetime | None = Field(
        None, description="When the job Succeeded or Failed."
    )
    message: str | None = Field(
        None, max_length=32_768, description="Human-readable summary of the current phase."
    )
    dropped_samples: dict[str, int] = Field(
        default_factory=dict,
        description="Trajectories dropped by the trainer's buffer, by reason (stale_version, "
        "expired, capacity, duplicate, malformed; no_signal: filtered by DAPO's dynamic "
        "sampling), as last reported.",
    )
    tokens_per_second: float | None = Field(None, description="Rollout throughput, last reported.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    degrade_action: str | None = Field(
        None,
        max_length=64,
        description="The degrade action in effect (spec.degrade.action) while Degraded.",
    )
    lag_above_since: AwareDatetime | None = Field(
        None,
        description="Since when the reported policy lag has been above maxPolicyLagMs "
        "(the degrade rule fires after degradeAfterSeconds).",
    )
    last_restart_time: AwareDatetime | None = Field(
        None, description="When the operator last restarted a role (backoff counts from here)."
    )
    scale_owner: str | None = Field(
        None,
        max_length=128,
        description="Field manager other than the operator (an HPA, kubectl scale) that wrote "
        "the scale subresource; while set, the built-in rollout autoscaler stays off.",
    )
    last_scale_time: AwareDatetime | None = Field(
        None, description="When the built-in elastic policy last changed the rollout replicas."
    )
    last_scale_direction: Literal["up", "down"] | None = Field(
        None,
        description="Which way the built-in elastic policy last scaled; scaling back the "
        "other way waits longer (hysteresis).",
    )
    last_scale_stale_drops: int | None = Field(
        None,
        ge=0,
        description="Samples the trainer had dropped as stale at the last change of rollout "
        "replicas; more since then ask for one rollout fewer.",
    )
    resume_from: str | None = Field(
        None,
        max_length=_PATH_MAX,
        description="Checkpoint the trainer group resumes from when it next starts (after a "
        "restart, a resume or a re-admission): the newest one reported; the trainers take a "
        "newer one when the volume holds it.",
    )
    kueue: KueueStatus | None = Field(
        None, description="Kueue admission (jobs with the label kueue.x-k8s.io/queue-name)."
    )
    utilization: dict[str, RoleUtilization] = Field(
        default_factory=dict,
        description="Per role (actor, rollout, trainer): idle fraction and GPU utilisation, "
        "as last reported.",
    )
    plan_summary: str | None = Field(
        None,
        max_length=4096,
        description="Recorded at creation (also as a Planned Event): why this topology (the "
        "topology: auto rule that decided), the fit verdict and each role's pods with GPUs and "
        "memory. rljob plan --model DIR gives the full memory estimate per pod.",
    )


class ObjectMeta(BaseModel):
    """The parts of metadata the operator uses; everything else is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str = ""
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLJob(BaseModel):
    """RLJob runs one LLM reinforcement-learning post-training job (PPO, GRPO or DAPO) on a
    colocated or disaggregated topology: the operator creates and supervises its rollout and
    trainer pods."""

    model_config = ConfigDict(
        extra="ignore", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    api_version: Literal["rljob.io/v1beta1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLJob"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RLJobSpec
    status: RLJobStatus | None = None


class RLJobV1Alpha1(BaseModel):
    """RLJob runs one LLM reinforcement-learning post-training job (PPO, GRPO or DAPO) on a
    colocated or disaggregated topology: the operator creates and supervises its rollout and
    trainer pods."""

    model_config = RLJob.model_config

    api_version: Literal["rljob.io/v1alpha1"] = Field("rljob.io/v1alpha1", alias="apiVersion")
    kind: Literal["RLJob"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RLJobSpecV1Alpha1
    status: RLJobStatus | None = None


ROOT_MODELS: Final[dict[str, type[BaseModel]]] = {VERSION: RLJob, V1ALPHA1: RLJobV1Alpha1}
"""Version name → the pydantic model of the whole object in that version."""
SPEC_MODELS: Final[dict[str, type[SpecModel]]] = {VERSION: RLJobSpec, V1ALPHA1: RLJobSpecV1Alpha1}


# ------------------------------------------------------------------- whole-object rules

NAME_MAX = 50
"""Longest RLJob name: its longest child name, ``<name>-trainer-1023`` (a pod hostname), and every
label value carrying the name must stay a DNS label of at most 63 characters."""
_NAME_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_RECREATE = (
    "delete the RLJob and create it again (it resumes from spec.checkpoint.claimName when set)"
)


@dataclass(frozen=True)
class ObjectRule:
    """A rule on the whole RLJob object (root ``x-kubernetes-validations``). Transition rules
    (``oldSelf``) compare an update with the stored object and are skipped on create.

    ``holds(old, new)`` is the Python twin, reading the same camelCase JSON (``old`` None on
    create)."""

    rule: str
    message: str
    holds: Callable[[JsonObject | None, JsonObject], bool]
    field_path: str | None  # None: metadata (the schema has no path into it)
    reason: Literal["FieldValueInvalid", "FieldValueForbidden"] = "FieldValueForbidden"

    def to_validation(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def _dig(obj: JsonObject | None, path: str) -> Any:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _immutable(path: str, why: str) -> ObjectRule:
    return ObjectRule(
        rule=f"self.{path} == oldSelf.{path}",
        message=f"{path} cannot change on an existing job ({why}); {_RECREATE}",
        holds=lambda old, new: old is None or _dig(old, path) == _dig(new, path),
        field_path=f".{path}",
    )


def _scale_fits(old: JsonObject | None, new: JsonObject) -> bool:
    if old is None or _dig(old, "spec.rollout.replicas") == _dig(new, "spec.rollout.replicas"):
        return True
    resolved = _dig(new, "status.resolvedTopology")
    if resolved is not None:
        return bool(resolved == "disaggregated")
    return bool(_dig(new, "spec.topology") != "colocated")


_RESOURCE_NAME = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMGTPE]i?"
    r"|[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)


def _resource_names_rule(role: str) -> ObjectRule:
    base = f"self.spec.{role}.resources"
    checks = " && ".join(
        f"(!has({base}.{k}) || {base}.{k}.all(r, r.matches('{_RESOURCE_NAME}')))"
        for k in ("requests", "limits")
    )

    def holds(_old: JsonObject | None, new: JsonObject) -> bool:
        res = _dig(new, f"spec.{role}.resources") or {}
        names = [n for k in ("requests", "limits") for n in (res.get(k) or {})]
        return all(re.fullmatch(_RESOURCE_NAME, str(n)) for n in names)

    return ObjectRule(
        rule=f"!has(self.spec.{role}) || !has({base}) || ({checks})",
        message=f"spec.{role}.resources: resource names are cpu, memory, ephemeral-storage, "
        "hugepages-<size> or an extended resource with a domain prefix (example.com/foo); "
        "fix or remove the unknown key",
        holds=holds,
        field_path=f".spec.{role}.resources",
        reason="FieldValueInvalid",
    )


OBJECT_RULES: tuple[ObjectRule, ...] = (
    ObjectRule(
        rule=f"size(self.metadata.name) <= {NAME_MAX} && self.metadata.name.matches('{_NAME_RE}')",
        message=f"metadata.name must be at most {NAME_MAX} characters of a-z, 0-9 and '-', "
        "starting with a letter (pod and Service names are built from it and must stay valid "
        "DNS labels); pick a shorter name",
        holds=lambda _old, new: bool(
            len(str(_dig(new, "metadata.name") or "")) <= NAME_MAX
            and re.fullmatch(_NAME_RE, str(_dig(new, "metadata.name") or ""))
        ),
        field_path=None,
        reason="FieldValueInvalid",
    ),
    _immutable("spec.topology", "the pods are laid out for it"),
    _immutable("spec.algorithm.name", "checkpoints and workers are built for it"),
    _immutable("spec.model", "the policy being trained"),
    _immutable("spec.trainer.replicas", "the trainers' data-parallel world size"),
    ObjectRule(
        rule="has(self.spec.managedBy) == has(oldSelf.spec.managedBy) && "
        "(!has(self.spec.managedBy) || self.spec.managedBy == oldSelf.spec.managedBy)",
        message="spec.managedBy cannot change on an existing job (one controller owns a job for "
        "its whole life); " + _RECREATE,
        holds=lambda old, new: (
            old is None or _dig(old, "spec.managedBy") == _dig(new, "spec.managedBy")
        ),
        field_path=".spec.managedBy",
    ),
    ObjectRule(
        rule="self.spec.rollout.replicas == oldSelf.spec.rollout.replicas || ("
        "has(self.status) && has(self.status.resolvedTopology) ? "
        "self.status.resolvedTopology == 'disaggregated' : self.spec.topology != 'colocated')",
        message="spec.rollout.replicas: this job runs colocated (status.resolvedTopology), where "
        "the rollout engine lives inside each of the spec.trainer.replicas actor pods, so "
        "kubectl scale and spec.rollout.replicas do not apply; the actor group size is fixed: "
        + _RECREATE,
        holds=_scale_fits,
        field_path=".spec.rollout.replicas",
    ),
    _resource_names_rule("rollout"),
    _resource_names_rule("trainer"),
)


def object_rule_problems(old: JsonObject | None, new: JsonObject) -> list[str]:
    """Messages of the whole-object rules ``new`` breaks (``old``: the stored object, if any)."""
    return [r.message for r in OBJECT_RULES if not r.holds(old, new)]


# ------------------------------------------------------------------------------- functions


class SpecError(ValueError):
    """An RLJob that cannot run. Each problem names the field path and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid RLJob:\n" + "\n".join(f"  {p}" for p in problems))


def parse_rljob(obj: Mapping[str, Any]) -> RLJob:
    """Validate an RLJob object of the hub version (as read from the API server or a manifest;
    ``rljob_operator.conversion.parse_any_version`` takes v1alpha1 too).

    Raises ``SpecError`` listing every problem as ``<field path>: <what is wrong and the fix>``.
    """
    job, problems = _validate(obj, RLJob)
    if problems or not isinstance(job, RLJob):
        raise SpecError(problems)
    return job


def version_problems(obj: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``obj`` in its own API version (v1alpha1 or v1beta1), field paths as the
    user wrote them; empty when it is valid."""
    version = str(obj.get("apiVersion", "")).removeprefix(f"{GROUP}/")
    return _validate(obj, ROOT_MODELS.get(version, RLJob))[1]


def _validate(obj: Mapping[str, Any], root: type[BaseModel]) -> tuple[BaseModel | None, list[str]]:
    named = bool(_dig(obj, "metadata.name"))
    problems = object_rule_problems(None, obj) if named else []
    try:
        job = root.model_validate(obj)
    except ValidationError as exc:
        return None, problems + [
            p for e in exc.errors(include_url=False) for p in _describe(e, root)
        ]
    return job, problems


def is_on_policy(algorithm: AlgorithmName) -> bool:
    """Whether ``algorithm`` needs fresh (zero-lag) data: ppo and grpo. dapo tolerates bounded
    staleness in this operator's fit table and runs on either topology."""
    return algorithm in ON_POLICY_ALGORITHMS


def resolve_topology(spec: RLJobSpec) -> tuple[ResolvedTopology, str]:
    """The topology a job runs on, and why. First match wins:

    1. ``spec.topology`` colocated or disaggregated: used as written.
    2. auto, on-policy algorithm (ppo, grpo) without a staleness bound (``staleness.correction``
       decoupledPPO|tis *and* ``staleness.maxVersions``): colocated, the only topology that keeps
       policy lag near zero.
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


def resolve_advantage_estimator(algorithm: Algorithm) -> AdvantageEstimator:
    """``algorithm.advantageEstimator``, or its default: gae for ppo, grpo for grpo and dapo."""
    if algorithm.advantage_estimator is not None:
        return algorithm.advantage_estimator
    return "gae" if algorithm.name == "ppo" else "grpo"


def resolve_clip_ratio_high(algorithm: Algorithm) -> float:
    """``clipRatioHigh``, or its default: DAPO's 0.28 (at least clipRatioLow) for dapo, else
    clipRatioLow (symmetric PPO clip)."""
    if algorithm.clip_ratio_high is not None:
        return algorithm.clip_ratio_high
    if algorithm.name == "dapo":
        return max(DAPO_CLIP_RATIO_HIGH, algorithm.clip_ratio_low)
    return algorithm.clip_ratio_low


def resolve_dynamic_sampling(algorithm: Algorithm) -> bool:
    """``dynamicSampling``, or its default: on for dapo."""
    if algorithm.dynamic_sampling is not None:
        return algorithm.dynamic_sampling
    return algorithm.name == "dapo"


def resolve_overlong(spec: RLJobSpec) -> tuple[bool, int, int]:
    """``(enabled, maxLength, cacheLength)`` of overlong shaping: on for dapo unless set,
    maxLength defaults to ``rollout.sampling.maxTokens``, cacheLength to a fifth of it."""
    buffer = spec.algorithm.overlong_buffer
    enabled = buffer.enabled if buffer.enabled is not None else spec.algorithm.name == "dapo"
    max_length = buffer.max_length or spec.rollout.sampling.max_tokens
    cache_length = buffer.cache_length if buffer.cache_length is not None else max_length // 5
    return enabled, max_length, cache_length


def resolve_loss_aggregation(algorithm: Algorithm) -> LossAggregation:
    """``lossAggregation``, or its default: Dr.GRPO's constant normaliser (``seq-mean-token-
    sum-norm``) with the dr-grpo estimator, token-mean otherwise."""
    if algorithm.loss_aggregation is not None:
        return algorithm.loss_aggregation
    if resolve_advantage_estimator(algorithm) == "dr-grpo":
        return "seq-mean-token-sum-norm"
    return "token-mean"


def responses_per_prompt(spec: RLJobSpec) -> int:
    """Responses per prompt: samplesPerPrompt, else groupSize with group advantages, else 1."""
    if spec.rollout.sampling.n is not None:
        return spec.rollout.sampling.n
    return 1 if resolve_advantage_estimator(spec.algorithm) == "gae" else spec.algorithm.group_size


def default_sharding(gradient_compression_type: str) -> Sharding:
    """What an unset ``trainer.sharding`` means: ddp with gradientCompression powerSGD (a DDP
    communication hook; a job stored before the field existed keeps validating and running as
    it did), fsdp otherwise."""
    return "ddp" if gradient_compression_type == "powerSGD" else "fsdp"


def resolve_sharding(trainer: Trainer) -> Sharding:
    """``trainer.sharding``, or its default (``default_sharding``)."""
    if trainer.sharding is not None:
        return trainer.sharding
    return default_sharding(trainer.gradient_compression.type)


def resolve_weight_sync_method(spec: RLJobSpec, topology: ResolvedTopology) -> WeightSyncMethod:
    """``weightSync.method``, or its default: inProcess when colocated, http when disaggregated."""
    if spec.weight_sync.method is not None:
        return spec.weight_sync.method
    return "inProcess" if topology == "colocated" else "http"


def all_cel_rules() -> dict[str, tuple[CelRule, ...]]:
    """Every model's cross-field rules, keyed by model name (for generators and tests)."""
    return {m.__name__: m.cel_rules for m in _spec_models(RLJobSpec) if m.cel_rules}


def _spec_models(root: type[SpecModel]) -> list[type[SpecModel]]:
    found: list[type[SpecModel]] = []
    pending: list[type[SpecModel]] = [root]
    while pending:
        model = pending.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            pending.extend(_models_in(field.annotation))
    return found


def _models_in(annotation: Any) -> list[type[SpecModel]]:
    if isinstance(annotation, type) and issubclass(annotation, SpecModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


# ------------------------------------------------------------------------- error messages


def _describe(error: Mapping[str, Any], root: type[BaseModel] = RLJob) -> list[str]:
    loc: tuple[str | int, ...] = tuple(error["loc"])
    path = _format_path(loc)
    kind = error["type"]
    if kind == RULE_ERROR:
        return [str(m) for m in error.get("ctx", {}).get("messages", [error["msg"]])]
    if kind == RELATIVE_ERROR:
        return [f"{path}.{m}" for m in error.get("ctx", {}).get("messages", [])]
    if kind == DUPLICATE_ERROR:
        return [f"{path}[{error['ctx']['index']}].name: {error['msg']}"]
    if kind == "missing":
        return [f"{path}: required field is missing; add it"]
    if kind == "extra_forbidden":
        return [f"{path}: unknown field; {_spelling_hint(loc, root)}"]
    got = repr(error.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return [f"{path}: {error['msg']} (got {got}); set a value that fits"]


def _format_path(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _spelling_hint(loc: tuple[str | int, ...], root: type[BaseModel]) -> str:
    parent = _model_at(loc[:-1], root)
    if parent is None:
        return "remove it"
    known = [f.alias or name for name, f in parent.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"did you mean {close[0]}?"
    return f"remove it (known fields: {', '.join(sorted(known))})"


def _model_at(loc: tuple[str | int, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    current: Any = root
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            args = get_args(current)
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, BaseModel):
            fields = {f.alias or n: f for n, f in current.model_fields.items()}
            field = fields.get(part) or current.model_fields.get(part)
            current = field.annotation if field else None
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` → ``X``."""
    if get_origin(annotation) in (types.UnionType, typing.Union):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation
