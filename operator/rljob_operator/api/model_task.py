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


DATASET_MOUNT = "/etc/rljob/dataset"
"""Where a dataset ConfigMap is mounted in the pods (``<mount>/<key>``)."""


class DatasetVolume(SpecModel):
    """A PersistentVolumeClaim holding the dataset, mounted read-only into every worker pod."""

    claim_name: str = Field(
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="Name of the PersistentVolumeClaim (same namespace) that holds the data.",
    )
    mount_path: str = Field(
        "/data",
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Where the claim is mounted; spec.task.dataset.path should lie under it.",
    )


class DatasetConfigMap(SpecModel):
    """A small dataset in a ConfigMap (at most 1 MiB), mounted read-only into the pods."""

    name: str = Field(max_length=_NAME_MAX, pattern=_DNS_SUBDOMAIN, description="ConfigMap.")
    key: str = Field(
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key holding the file, e.g. train.jsonl (its extension names the "
        "format unless spec.task.dataset.format says it).",
    )


class Dataset(SpecModel):
    """Rows of prompt and reference answer: a JSONL, JSON or parquet file inside the pods, on a
    volume (the model's, or spec.task.dataset.volume) or from a ConfigMap. Checked when the
    workers start: a missing file, a bad line or a missing field fails the job with an Event and
    condition naming it (the file, the line or row, the field and the fix)."""

    path: str | None = Field(
        None,
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Absolute path of the file inside the pods, e.g. /data/gsm8k/train.parquet.",
    )
    volume: DatasetVolume | None = Field(
        None, description="A PVC holding the dataset, mounted read-only in every worker pod."
    )
    config_map: DatasetConfigMap | None = Field(
        None, description="A ConfigMap holding the dataset (instead of path)."
    )
    format: Literal["auto", "jsonl", "json", "parquet"] = Field(
        "auto", description="The file's format. auto: by its extension."
    )
    prompt_field: str = Field(
        "prompt", max_length=_NAME_MAX, description="The column holding the prompt text."
    )
    answer_field: str = Field(
        "answer", max_length=_NAME_MAX, description="The column holding the reference answer."
    )
    messages_field: str | None = Field(
        None,
        max_length=_NAME_MAX,
        description="A column of chat messages ([{role, content}, ...]) used as the prompt "
        "instead of promptField (a trailing assistant message is dropped). Needs "
        "spec.task.chatTemplate: auto.",
    )
    limit: int | None = Field(
        None, ge=1, le=100_000_000, description="Use the first N rows (after shuffle)."
    )
    shuffle: bool = Field(False, description="Shuffle the rows (with seed) before limit.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the shuffle.")

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.path) != has(self.configMap)",
            message="spec.task.dataset: set exactly one of path and configMap",
            holds=lambda d: ("path" in d) != ("configMap" in d),
        ),
        CelRule(
            rule="!has(self.configMap) || !has(self.volume)",
            message="spec.task.dataset: a configMap dataset needs no volume; remove volume",
            holds=lambda d: "configMap" not in d or "volume" not in d,
            field_path=".volume",
        ),
    )


EVAL_DATASET_MOUNT = "/etc/rljob/eval-dataset"
"""Where an eval dataset ConfigMap is mounted in the pods (``<mount>/<key>``)."""


class Eval(SpecModel):
    """Held-out evaluation on the rollout engines: accuracy (pass@1) and mean reward of the
    policy on rows it does not train on, scored by the job's reward. In status.eval, the
    metrics rljob_eval_accuracy and rljob_eval_reward_mean, the tracking backends and
    rljob plot."""

    dataset: Dataset = Field(
        description="The held-out rows (the same fields as spec.task.dataset; a volume or "
        "ConfigMap of its own is mounted beside the training one)."
    )
    every_steps: int = Field(
        20,
        ge=1,
        le=1_000_000,
        description="Evaluate every N steps, and at the end; a colocated job also evaluates "
        "the policy it resumed. Disaggregated: the first rollout evaluates each policy version "
        "crossing a multiple of N as soon as it serves it.",
    )
    samples: int = Field(64, ge=1, le=1_000_000, description="Rows evaluated (the first N).")
    greedy: bool = Field(
        True, description="Greedy decoding (temperature 0); false: spec.rollout.sampling."
    )
    pass_reward: float = Field(
        1.0,
        ge=-1000,
        le=1000,
        description="A response passes when its reward reaches this (1.0: the math or exact "
        "term right).",
    )


RewardTermType = Literal["math", "exact", "regex", "format", "code", "http", "function"]


class RewardTerm(SpecModel):
    """One weighted term of the reward; the reward is the sum of weight × term."""

    type: RewardTermType = Field(
        description="math: the response's final answer (last \\boxed{}, else after ####, else "
        "in <answer> tags) verified against the reference with math-verify (a GSM8K reference "
        "counts by what follows ####). exact: the trimmed response equals the answer. regex: "
        "pattern extracts the answer (its first group). format: the response holds one "
        "<tag>...</tag> (tag, default answer) or matches pattern as a whole. code: the "
        "response's program passes the row's tests (testsField) in a sandbox: time and memory "
        "limits, no network, a scratch directory removed afterwards. http: a verifier or reward "
        "model service scores batches. function: module:function(response, answer, **row "
        "columns) importable in the worker image."
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="The term's weight.")
    pattern: str | None = Field(
        None, max_length=1024, description="regex: extracts the answer; format: must match."
    )
    tag: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z][-_A-Za-z0-9]*$",
        description="format: the tag the answer sits in (default answer).",
    )
    function: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_IMPORT_PATH,
        description="function: the import path module:function.",
    )
    url: str | None = Field(
        None,
        max_length=_PATH_MAX,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description='http: the service\'s URL, POSTed {"samples": [{prompt, response, answer, '
        'extra}]} and answering {"rewards": [number, ...]}; e.g. an in-cluster Service '
        "http://verifier.team.svc:8000/score.",
    )
    timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="http: one request; code: one run of the tests."
    )
    retries: int = Field(2, ge=0, le=10, description="http: attempts after a failed one.")
    concurrency: int = Field(4, ge=1, le=256, description="http: requests in flight.")
    batch_size: int = Field(32, ge=1, le=4096, description="http: samples per request.")
    memory_mib: int = Field(
        512, ge=64, le=65536, description="code: the program's address-space limit."
    )
    tests_field: str = Field(
        "tests",
        max_length=_NAME_MAX,
        description="code: the dataset column holding the tests (Python asserts, a string or "
        "a list of them).",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="self.type != 'regex' || has(self.pattern)",
            message="spec.task.reward.terms[]: a regex term needs pattern",
            holds=lambda t: t.get("type") != "regex" or "pattern" in t,
            field_path=".pattern",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="self.type != 'http' || has(self.url)",
            message="spec.task.reward.terms[]: an http term needs url",
            holds=lambda t: t.get("type") != "http" or "url" in t,
            field_path=".url",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="self.type != 'function' || has(self.function)",
            message="spec.task.reward.terms[]: a function term needs function (module:function)",
            holds=lambda t: t.get("type") != "function" or "function" in t,
            field_path=".function",
            reason="FieldValueRequired",
        ),
    )


class Reward(SpecModel):
    """How a response is scored: weighted terms (terms), or one function."""

    function: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_IMPORT_PATH,
        description="Import path 'module:function' of a reward function (response, answer) "
        "-> float, importable in the worker image. Unset and no terms: the built-in exact-match "
        "reward (1.0 when the response equals the answer, 0.1 for a right first character).",
    )
    terms: list[RewardTerm] = Field(
        default_factory=list,
        max_length=16,
        description="Weighted terms summed into the reward, e.g. [{type: math}, {type: format, "
        "weight: 0.2}]. Computed off the generation thread, concurrently, in batches.",
    )
    timeout_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Wall-clock limit of scoring one sample. A sample whose reward runs past "
        "it or raises is failed: it scores failureValue, the failure is counted "
        "(rljob_reward_failures_total{reason=timeout|error}) and the worker goes on.",
    )
    failure_value: float | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="The score of a failed sample. Unset: none, and its group is left out of "
        "the step (as a NaN reward's).",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.function) || !has(self.terms) || size(self.terms) == 0",
            message="spec.task.reward: set function or terms, not both (a function term "
            "goes in terms as {type: function, function: ...})",
            holds=lambda r: "function" not in r or not r.get("terms"),
        ),
    )


class Task(SpecModel):
    """The prompts to train on and their reward: exactly one of builtin and datasetPath."""

    builtin: BuiltinTask | None = Field(None, description="A built-in toy task.")
    dataset_path: str | None = Field(
        None,
        max_length=_PATH_MAX,
        pattern=r"^/",
        description="Absolute path, inside the pods, of a JSONL file with one "
        '{"prompt": ..., "answer": ...} object per line (the same as dataset: {path: ...}).',
    )
    dataset: Dataset | None = Field(
        None, description="A dataset file: JSONL, JSON or parquet, with field mapping."
    )
    chat_template: Literal["auto", "none"] | None = Field(
        None,
        description="auto: each prompt goes through the tokenizer's chat template with the "
        "generation prompt added, and the engines get those token ids (the trainer learns from "
        "the engines' own prompt and response ids: nothing is re-tokenised). none: the prompt "
        "text as it is. Unset: auto for a dataset with messagesField, else none.",
    )
    eval: Eval | None = Field(None, description="Held-out evaluation during training.")
    system_prompt: str | None = Field(
        None,
        max_length=16384,
        description="A system message before each prompt (with chatTemplate none: its text and "
        "a blank line before the prompt).",
    )
    reward: Reward = _nested(Reward, "Reward function.")
    long_chain_reasoning: bool = Field(
        False,
        description="Responses are long chains of reasoning (long, variable generation time). "
        "With topology auto this favours disaggregated for dapo or staleness-corrected jobs.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="has(self.builtin) ? (!has(self.datasetPath) && !has(self.dataset)) : "
            "(has(self.datasetPath) != has(self.dataset))",
            message="spec.task: set exactly one of spec.task.builtin, spec.task.dataset and "
            "spec.task.datasetPath",
            holds=lambda t: sum(k in t for k in ("builtin", "datasetPath", "dataset")) == 1,
        ),
        CelRule(
            rule="!has(self.dataset) || !has(self.dataset.messagesField) || "
            "!has(self.chatTemplate) || self.chatTemplate == 'auto'",
            message="spec.task.chatTemplate: a dataset of chat messages (messagesField) needs "
            "chatTemplate auto",
            holds=lambda t: (
                "dataset" not in t
                or "messagesField" not in t["dataset"]
                or t.get("chatTemplate", "auto") == "auto"
            ),
            field_path=".chatTemplate",
        ),
    )
