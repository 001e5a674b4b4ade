"""What the worker pods of every role share: resources, placement, pod-template overrides (and
the fields the operator owns, which they may not touch), image and environment."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Literal, Self

from pydantic import Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rljob_operator.api.cel import CelRule, ItemRules, JsonObject, SpecModel
from rljob_operator.api.errors import DUPLICATE_ERROR, RELATIVE_ERROR
from rljob_operator.api.fields import (
    _DNS_SUBDOMAIN,
    _GPU_RESOURCE,
    _LIST_MAX,
    _NAME_MAX,
    POSITIVE_QUANTITY_RULE,
    Quantity,
    quantity_is_positive,
)
from rljob_operator.api.k8s import Affinity, EnvFromSource, Volume, VolumeMount, crd_schema
from rljob_operator.api.k8s import EnvVar as CoreEnvVar
from rljob_operator.api.versions import GROUP

_SIZED_CEL: Final = "k == 'memory' || k == 'ephemeral-storage' || k.startsWith('hugepages-')"


def _sized(resource: str) -> bool:
    """Resources that are sizes (a size of zero or less is refused)."""
    return resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-")


def _sizes_positive(role: str) -> CelRule:
    """memory, ephemeral-storage and hugepages-* of spec.<role>.resources are above zero."""

    def holds(r: JsonObject) -> bool:
        res = r.get("resources", {})
        return all(
            quantity_is_positive(v)
            for kind in ("requests", "limits")
            for k, v in res.get(kind, {}).items()
            if _sized(k)
        )

    def sized_positive(kind: str) -> str:
        where = f"self.resources.{kind}"
        return (
            f"(!has({where}) || {where}.all(k, !({_SIZED_CEL}) || "
            f"{POSITIVE_QUANTITY_RULE.replace('self', f'{where}[k]')}))"
        )

    return CelRule(
        rule=f"!has(self.resources) || ({sized_positive('requests')} && "
        f"{sized_positive('limits')})",
        message=f"spec.{role}.resources: memory, ephemeral-storage and hugepages-* must be "
        "greater than zero, e.g. '8Gi'; remove the entry or set a size",
        holds=holds,
        field_path=".resources",
    )


def positive_size(field: str, where: str) -> CelRule:
    """``field`` of this object (a quantity, ``where`` its spec path) is above zero, if set."""
    return CelRule(
        rule=f"!has(self.{field}) || " + POSITIVE_QUANTITY_RULE.replace("self", f"self.{field}"),
        message=f"{where}: must be greater than zero, e.g. '1Gi' (a size of 0 is refused); "
        "set a size",
        holds=lambda obj: field not in obj or quantity_is_positive(obj[field]),
        field_path=f".{field}",
    )


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


CONTROL_PLANE_TAINTS: Final = (
    "node-role.kubernetes.io/control-plane",
    "node-role.kubernetes.io/master",
)
"""Taints of control-plane nodes: no worker pod tolerates them."""


def _tolerates_control_plane(t: JsonObject) -> bool:
    key = t.get("key") or ""
    return key in CONTROL_PLANE_TAINTS if key else t.get("operator") == "Exists"


class Toleration(SpecModel):
    """A Kubernetes toleration (core/v1 Toleration); never of the control-plane taints."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!(has(self.key) && self.key != '' ? self.key in ["
            + ", ".join(f"'{k}'" for k in CONTROL_PLANE_TAINTS)
            + "] : self.operator == 'Exists')",
            message="spec.scheduling.tolerations, spec.<role>.podTemplateOverrides.tolerations: "
            f"a toleration of {' or '.join(CONTROL_PLANE_TAINTS)} (or of every taint: operator "
            "Exists without a key) is refused: worker pods do not run on control-plane nodes; "
            "tolerate the taints of your worker nodes by key",
            holds=lambda t: not _tolerates_control_plane(t),
            field_path=".key",
            reason="FieldValueForbidden",
        ),
    )

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
"""A free-form object (kept for callers of the API; the pod-template overrides use the real core/v1
schemas of ``api.k8s`` instead)."""


OPERATOR_VOLUMES: Final = (
    "config",
    "tmp",
    "home",
    "dshm",
    "checkpoints",
    "model",
    "data-plane-tls",
)
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
_OWNED_ENV_CEL = (
    "(self.name in ["
    + ", ".join(f"'{name}'" for name in OPERATOR_ENV)
    + "] || "
    + " || ".join(f"self.name.startsWith('{prefix}')" for prefix in OPERATOR_ENV_PREFIXES)
    + ")"
)
"""CEL of "this env var is one the operator sets" (a rule of the list item: cheap to estimate)."""
_OWNED_ENV_TEXT = (
    " is set by the operator (it would override what the workers need to run); use another name"
)


def operator_owned_env(name: str) -> bool:
    """Whether the operator sets variable ``name`` in the worker containers."""
    return name in OPERATOR_ENV or name.startswith(OPERATOR_ENV_PREFIXES)


def _prefix_reaches_owned_env(prefix: str) -> bool:
    """Whether an envFrom ``prefix`` followed by some key names a variable under an owned prefix
    (RLJOB_*): it leads into that prefix or starts with it."""
    return bool(prefix) and any(
        owned.startswith(prefix) or prefix.startswith(owned) for owned in OPERATOR_ENV_PREFIXES
    )


_OWNED_LEADS = [p[:i] for p in OPERATOR_ENV_PREFIXES for i in range(1, len(p))]
"""The proper leading parts of the owned prefixes (CEL tests membership: cheap to estimate,
unlike a startsWith whose argument is the user's string)."""
ENV_FROM_PREFIX_RULE: Final = CelRule(
    rule="!has(self.prefix) || !(self.prefix in ["
    + ", ".join(f"'{lead}'" for lead in _OWNED_LEADS)
    + "] || "
    + " || ".join(f"self.prefix.startsWith('{p}')" for p in OPERATOR_ENV_PREFIXES)
    + ")",
    message="spec.<role>.podTemplateOverrides.envFrom: with this prefix a key of the Secret or "
    "ConfigMap can become an "
    + " or ".join(f"{p}*" for p in OPERATOR_ENV_PREFIXES)
    + " variable, which the operator owns; use a prefix of your own (e.g. APP_) or none",
    holds=lambda e: not _prefix_reaches_owned_env(str(e.get("prefix", ""))),
    field_path=".prefix",
    reason="FieldValueForbidden",
)
"""An envFrom source of the overrides (a Secret or ConfigMap the spec names) cannot reach the
operator's RLJOB_* variables through its prefix. The single names the operator sets (MASTER_ADDR,
HOME, ...) need no rule: a container's env, where it sets them, wins over its envFrom."""
OverrideEnvFrom = Annotated[EnvFromSource, ItemRules("EnvFromSource", (ENV_FROM_PREFIX_RULE,))]


def _listed(words: tuple[str, ...]) -> str:
    """``a, b and c``."""
    return ", ".join(words[:-1]) + f" and {words[-1]}"


RESTRICTED_VOLUMES: Final = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
"""The volume types of Pod Security "restricted": the only ones a job may add to its pods."""
_REFUSED_VOLUMES = tuple(
    sorted(set(crd_schema("Volume")["properties"]) - {"name", *RESTRICTED_VOLUMES})
)
RESTRICTED_VOLUME_RULE: Final = CelRule(
    rule=" && ".join(f"!has(self.{kind})" for kind in _REFUSED_VOLUMES),
    message=f"spec.<role>.podTemplateOverrides.volumes: only {_listed(RESTRICTED_VOLUMES)} "
    "volumes are allowed (Pod Security restricted: the operator creates the pods with its own "
    "rights); reach other storage (hostPath, nfs, iscsi, ...) through a PersistentVolumeClaim",
    holds=lambda v: not any(kind in v for kind in _REFUSED_VOLUMES),
    reason="FieldValueForbidden",
)
OverrideVolume = Annotated[Volume, ItemRules("Volume", (RESTRICTED_VOLUME_RULE,))]

REFUSED_ANNOTATION_PREFIXES: Final = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
    "io.kubernetes.cri-o.",
    f"{GROUP}/",
)
"""Pod annotation keys a job may not set: AppArmor and seccomp profiles, CRI-O's runtime
annotations (user namespaces, devices, cgroups) and the operator's own."""
ANNOTATIONS_RULE: Final = CelRule(
    rule="!has(self.annotations) || self.annotations.all(k, "
    + " && ".join(f"!k.startsWith('{p}')" for p in REFUSED_ANNOTATION_PREFIXES)
    + ")",
    message="spec.<role>.podTemplateOverrides.annotations: keys under "
    f"{_listed(REFUSED_ANNOTATION_PREFIXES)} are refused (the pods' AppArmor, seccomp and "
    "runtime settings are the operator's, and so is rljob.io/); remove the key",
    holds=lambda o: (
        not any(k.startswith(REFUSED_ANNOTATION_PREFIXES) for k in o.get("annotations", {}))
    ),
    field_path=".annotations",
    reason="FieldValueForbidden",
)

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
    environment variables and labels) are refused with the field path, and so is what would make
    a pod more than Pod Security "restricted" allows (other volume types, AppArmor, seccomp and
    runtime annotations, control-plane tolerations): creating an RLJob grants no more than
    creating such a pod in its namespace would."""

    labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=64, description="Extra pod labels."
    )
    annotations: dict[str, Annotated[str, Field(max_length=32_768)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod annotations (not AppArmor, seccomp, CRI-O runtime or rljob.io/ "
        "keys).",
    )
    volumes: list[OverrideVolume] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra pod volumes (core/v1), of the Pod Security restricted types: "
        "configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, "
        "secret.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra volumeMounts of the worker container (core/v1 VolumeMount).",
    )
    env: list[CoreEnvVar] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra environment variables (core/v1 EnvVar: value or valueFrom, e.g. "
        "secretKeyRef), after spec.worker.env (on a repeated name these win).",
    )
    env_from: list[OverrideEnvFrom] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Extra envFrom sources of the worker container (core/v1 EnvFromSource, "
        "e.g. secretRef) of the Secrets and ConfigMaps named here; a prefix may not lead into "
        "RLJOB_ (the operator's variables).",
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels these pods require, added to spec.scheduling.nodeSelector.",
    )
    affinity: Affinity | None = None
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Tolerations added to these pods (after spec.scheduling.tolerations).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=_LIST_MAX, description="Image pull Secrets."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (ANNOTATIONS_RULE,)

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
            elif operator_owned_env(name):
                out.append(f"env[{i}].name: {name} is set by the operator; use another name")
        return out


def _under(path: str, owned: str) -> bool:
    """Whether mount path ``path`` is ``owned`` or lies inside it."""
    a, b = path.rstrip("/") or "/", owned.rstrip("/") or "/"
    return a == b or a.startswith(b + "/")


class EnvVar(SpecModel):
    """An environment variable for the worker containers (not one the operator sets)."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule=f"!{_OWNED_ENV_CEL}",
            message="spec.worker.env: MASTER_ADDR, MASTER_PORT, POD_NAME, POD_NAMESPACE, HOME, "
            "XDG_CACHE_HOME, HF_HUB_OFFLINE and RLJOB_* are set by the operator; use another name",
            message_expression=f"'spec.worker.env: ' + self.name + '{_OWNED_ENV_TEXT}'",
            holds=lambda e: not operator_owned_env(str(e.get("name", ""))),
            render=lambda e: f"spec.worker.env: {e.get('name')}{_OWNED_ENV_TEXT}",
            field_path=".name",
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=_NAME_MAX,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name.",
    )
    value: str = Field("", max_length=32_768, description="Variable value.")


class WorkerPods(SpecModel):
    """Settings every worker pod shares: image, environment, account, shutdown, /dev/shm."""

    image: str | None = Field(
        None,
        max_length=512,
        description="Worker container image (it runs as non-root uid 1000 under the Pod "
        "Security restricted context). Unset: the image the operator was installed with.",
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
        "report progress (get/patch of the job's progress ConfigMap); a set account must exist "
        "and be one the operator allows (its --allowed-service-accounts, chart value "
        "worker.allowedServiceAccounts), else the job fails with ServiceAccountNotAllowed.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (positive_size("shmSize", "spec.worker.shmSize"),)

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
