"""The whole RLJob object in each served version, and parsing it into the hub model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rljob_operator.api.cel import SpecModel
from rljob_operator.api.errors import SpecError, _describe
from rljob_operator.api.object_rules import _dig, object_rule_problems
from rljob_operator.api.spec import RLJobSpec, RLJobSpecV1Alpha1
from rljob_operator.api.status import RLJobStatus
from rljob_operator.api.versions import API_VERSION, GROUP, KIND, V1ALPHA1, VERSION


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
