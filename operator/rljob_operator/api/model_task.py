"""spec.model and spec.task: the policy model to train, the prompts and their reward."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.cel import CelRule, SpecModel, _nested
from rljob_operator.api.fields import _DNS_SUBDOMAIN, _IMPORT_PATH, _NAME_MAX, _PATH_MAX


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
    timeout_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Wall-clock limit of one reward call. A call that runs past it or raises "
        "scores NaN: its group is left out of the step, the failure is counted "
        "(rljob_reward_failures_total{reason=timeout|error}) and the worker goes on.",
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
