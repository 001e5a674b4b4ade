"""``rljob plan``: what a job will run as and what it will cost, before anything runs.

Pure (no client, no clock, no file reads): the CLI reads the manifest, the model's
``config.json``, the nodes and the committed matrix results, and hands them in as values.

- ``decision_path``: the README's ``topology: auto`` rule, one step per rule, each naming the
  fields it looked at and whether it decided.
- ``estimate_pod_memory``: accelerator memory per pod from the model shape: policy weights,
  reference, critic, optimizer state (Adam: two fp32 moments, plus an fp32 master copy when the
  weights are 16-bit), gradients, the KV-cache budget of the engine and activation memory with and
  without gradient checkpointing.
- ``build_plan``: pods (from ``builders.build_children``, never rebuilt here), per-pod estimate
  against the memory available to the pod, headroom verdict, fit verdict and the nearest measured
  cell of the algorithm × topology matrix (``bench/results/matrix.json``).
- ``build_plan_summary``: the short text the operator records at creation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rljob_operator.api import (
    ResolvedTopology,
    RLJob,
    RLJobSpec,
    is_on_policy,
    resolve_advantage_estimator,
    resolve_topology,
    responses_per_prompt,
)
from rljob_operator.builders import JobRef, build_children, role_gpus

DEFAULT_HEADROOM = 0.15
DEFAULT_PROMPT_TOKENS = 64
GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}

Verdict = Literal["fits", "tight", "does-not-fit", "unknown"]


class PlanError(ValueError):
    """A manifest or input that cannot be planned; the message names the field and the fix."""


def parse_memory_quantity(value: str | int, *, field_path: str) -> int:
    """Bytes of a Kubernetes memory quantity (``16Gi``, ``500M``, ``1048576``)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(|k|M|G|T|Ki|Mi|Gi|Ti)", str(value).strip())
    if not match:
        raise PlanError(f"{field_path}: {value!r} is not a memory quantity such as 16Gi or 80G")
    return int(float(match.group(1)) * _SUFFIX[match.group(2)])


# --------------------------------------------------------------------------- decision path


@dataclass(frozen=True)
class DecisionStep:
    """One rule of the ``topology: auto`` decision path."""

    rule: int
    text: str
    fields: dict[str, Any]
    matched: bool


def decision_path(spec: RLJobSpec) -> tuple[ResolvedTopology, str, list[DecisionStep]]:
    """The resolved topology, its reason (``api.resolve_topology``) and the rules that were
    looked at, in order, up to the one that decided (first match wins)."""
    topology, reason = resolve_topology(spec)
    name = spec.algorithm.name
    bounded = spec.staleness.correction != "none" and spec.staleness.max_versions is not None
    staleness = {
        "spec.staleness.correction": spec.staleness.correction,
        "spec.staleness.maxVersions": spec.staleness.max_versions,
    }
    rules = [
        DecisionStep(
            1,
            "an explicit colocated/disaggregated topology is used as written",
            {"spec.topology": spec.topology},
            spec.topology != "auto",
        ),
        DecisionStep(
            2,
            "an on-policy algorithm (ppo, grpo) without a staleness bound -> colocated",
            {"spec.algorithm.name": name, **staleness},
            is_on_policy(name) and not bounded,
        ),
        DecisionStep(
            3,
            "objective utilization or long-chain reasoning, with dapo or a staleness bound "
            "-> disaggregated",
            {
                "spec.objective": spec.objective,
                "spec.task.longChainReasoning": spec.task.long_chain_reasoning,
                "spec.algorithm.name": name,
            },
            spec.objective == "utilization" or spec.task.long_chain_reasoning,
        ),
        DecisionStep(4, "otherwise -> colocated", {"spec.objective": spec.objective}, True),
    ]
    path: list[DecisionStep] = []
    for step in rules:
        path.append(step)
        if step.matched:
            break
    return topology, reason, path


def fit_verdict(spec: RLJobSpec, topology: ResolvedTopology) -> tuple[bool, str]:
    """Whether the algorithm fits the topology (the README's fit table) and why."""
    name = spec.algorithm.name
    if topology == "colocated":
        return True, f"{name} on colocated: on-policy data (policy lag ~0), fits every algorithm"
    if is_on_policy(name):
        return True, (
            f"{name} on disaggregated with correction {spec.staleness.correction} and "
            f"maxVersions {spec.staleness.max_versions}: fits as an off-policy-corrected job"
        )
    bound = spec.staleness.max_versions
    if bound is None:
        return True, "dapo on disaggregated: fits; no spec.staleness.maxVersions bounds the lag"
    return True, f"dapo on disaggregated with maxVersions {bound}: fits"


# ------------------------------------------------------------------------------ memory


@dataclass(frozen=True)
class ModelShape:
    """The parts of a Hugging Face decoder ``config.json`` the estimate needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, source: str) -> ModelShape:
        """Read a decoder's shape; ``source`` names the file in errors."""
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "intermediate_size",
                "num_attention_heads",
            )
            if not isinstance(config.get(k), int)
        ]
        if missing:
            raise PlanError(
                f"spec.model.path: {source} lacks {', '.join(missing)}; point --model at a "
                "Hugging Face decoder folder (config.json of a Llama/Qwen2-style model)"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (attention with q/k/v biases, SwiGLU MLP, 2 norms)."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * q + q + 2 * (h * kv + kv) + q * h
        return attention + 3 * h * self.intermediate_size + 2 * h

    def parameters(self) -> int:
        """Parameters of the causal LM (embeddings, layers, final norm, untied LM head)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * self.layer_parameters() + self.hidden_size + head

    def critic_parameters(self) -> int:
        """Parameters of the value model: the backbone plus a scalar head."""
        embed = self.vocab_size * self.hidden_size
        return embed + self.num_layers * self.layer_parameters() + 2 * self.hidden_size + 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per component for one pod; ``total`` uses the job's gradient-checkpointing setting."""

    components: dict[str, int]
    activations_full: int
    activations_checkpointed: int
    gradient_checkpointing: bool

    @property
    def total(self) -> int:
        act = (
            self.activations_checkpointed if self.gradient_checkpointing else self.activations_full
        )
        return sum(self.components.values()) + act

    @property
    def total_other_setting(self) -> int:
        """The total with gradient checkpointing flipped (what turning it on/off would give)."""
        act = (
            self.activations_full if self.gradient_checkpointing else self.activations_checkpointed
        )
        return sum(self.components.values()) + act


def _trainer_state(params: int, dtype_bytes: int) -> dict[str, int]:
    master = 0 if dtype_bytes == 4 else 4 * params
    return {
        "weights": params * dtype_bytes,
        "gradients": params * dtype_bytes,
        "adam_moments_fp32": 2 * 4 * params,
        "fp32_master": master,
    }


def activation_bytes(
    shape: ModelShape, *, rows: int, seq_len: int, dtype_bytes: int, checkpointed: bool
) -> int:
    """Activation memory of one training forward kept for backward (SDPA attention, so no
    seq×seq score matrix is stored). Per layer and token: ~8 hidden-sized tensors (norm inputs,
    q/k/v/o inputs and outputs, residuals), 2 kv-sized and 4 intermediate-sized (gate, up, act,
    product). Checkpointing keeps only each layer's input plus one recomputed layer. Either way
    the backward pass holds one layer's activation gradients at a time, and the logits
    (vocab-sized, kept in fp32 for the log-softmax) are added."""
    tokens = rows * seq_len
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    per_layer = tokens * (8 * h + 2 * kv + 4 * shape.intermediate_size) * dtype_bytes
    logits = tokens * shape.vocab_size * (dtype_bytes + 2 * 4)
    backward = per_layer
    if checkpointed:
        return shape.num_layers * tokens * h * dtype_bytes + per_layer + backward + logits
    return shape.num_layers * per_layer + backward + logits


def kv_cache_bytes(shape: ModelShape, *, sequences: int, seq_len: int, dtype_bytes: int) -> int:
    """KV cache for ``sequences`` concurrent sequences of ``seq_len`` tokens."""
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
    return per_token * sequences * seq_len


def estimate_pod_memory(
    spec: RLJobSpec,
    topology: ResolvedTopology,
    role: str,
    shape: ModelShape,
    *,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> MemoryEstimate:
    """Memory one pod of ``role`` needs (see the module docstring for the parts)."""
    b = DTYPE_BYTES[spec.model.dtype]
    params = shape.parameters()
    seq_len = prompt_tokens + spec.rollout.sampling.max_tokens
    n = responses_per_prompt(spec)
    algo = spec.algorithm
    components: dict[str, int] = {}
    full = checkpointed = 0
    if role in ("actor", "trainer"):
        world = spec.trainer.replicas
        for k, v in _trainer_state(params, b).items():
            components[f"policy_{k}"] = v
        if algo.kl_coef > 0:
            components["reference_weights"] = params * b
        critic = resolve_advantage_estimator(algo) == "gae"
        if critic:
            for k, v in _trainer_state(shape.critic_parameters(), b).items():
                components[f"critic_{k}"] = v
        mini = algo.mini_batch_size or algo.batch_size
        rows = max(1, math.ceil(mini * n / world))
        for flag in (False, True):
            act = activation_bytes(
                shape, rows=rows, seq_len=seq_len, dtype_bytes=b, checkpointed=flag
            )
            if critic:
                act += activation_bytes(
                    shape, rows=rows, seq_len=seq_len, dtype_bytes=b, checkpointed=flag
                ) - rows * seq_len * shape.vocab_size * (b + 8)
            if flag:
                checkpointed = act
            else:
                full = act
    if role in ("actor", "rollout"):
        engines = spec.trainer.replicas if role == "actor" else spec.rollout.replicas
        sequences = max(1, math.ceil(algo.batch_size * n / engines))
        components["engine_weights"] = params * b
        components["kv_cache"] = kv_cache_bytes(
            shape, sequences=sequences, seq_len=seq_len, dtype_bytes=b
        )
    return MemoryEstimate(components, full, checkpointed, spec.trainer.gradient_checkpointing)


# --------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PodPlan:
    """One pod the operator would create, with its estimate and headroom."""

    name: str
    role: str
    gpus: int
    requests: dict[str, Any]
    limits: dict[str, Any]
    memory: MemoryEstimate | None
    capacity_bytes: int | None
    capacity_source: str
    headroom: float | None
    verdict: Verdict


@dataclass(frozen=True)
class PodCapacity:
    """Memory available to one pod: ``gpu_bytes`` per GPU for GPU pods, ``host_bytes`` for
    CPU pods (``None``: unknown) and where the number came from."""

    gpu_bytes: int | None = None
    host_bytes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class NearestCell:
    """The closest measured cell of the committed matrix, or why none is near."""

    near: bool
    cell: dict[str, Any] | None
    differences: list[str]
    note: str


@dataclass(frozen=True)
class JobPlan:
    """Everything ``rljob plan`` prints."""

    name: str
    topology: ResolvedTopology
    reason: str
    path: list[DecisionStep]
    fits_algorithm: bool
    fit_reason: str
    pods: list[PodPlan]
    headroom_required: float
    nearest: NearestCell
    warnings: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        """does-not-fit if any pod does, else tight, else unknown, else fits."""
        verdicts = {p.verdict for p in self.pods}
        if not self.fits_algorithm or "does-not-fit" in verdicts:
            return "does-not-fit"
        for v in ("tight", "unknown"):
            if v in verdicts:
                return v
        return "fits"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``--output json``)."""
        out = asdict(self)
        out["verdict"] = self.verdict
        for pod, plan in zip(out["pods"], self.pods, strict=True):
            if plan.memory is not None:
                pod["memory"]["totalBytes"] = plan.memory.total
                pod["memory"]["totalBytesOtherCheckpointing"] = plan.memory.total_other_setting
        return out


GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB per GPU, set by NVIDIA GPU feature discovery


def capacity_from_nodes(nodes: Sequence[Mapping[str, Any]]) -> PodCapacity:
    """The most memory one pod can get on these nodes: the largest per-GPU memory among GPU
    nodes (label ``nvidia.com/gpu.memory``, MiB) and the largest allocatable host memory."""
    gpu: list[int] = []
    host: list[int] = []
    for node in nodes:
        labels = node.get("metadata", {}).get("labels", {})
        allocatable = node.get("status", {}).get("allocatable", {})
        if str(labels.get(GPU_MEMORY_LABEL, "")).isdigit():
            gpu.append(int(labels[GPU_MEMORY_LABEL]) * 2**20)
        if "memory" in allocatable:
            name = node.get("metadata", {}).get("name", "?")
            host.append(
                parse_memory_quantity(
                    allocatable["memory"], field_path=f"node {name} status.allocatable.memory"
                )
            )
    return PodCapacity(
        gpu_bytes=max(gpu) if gpu else None,
        host_bytes=max(host) if host else None,
        source=f"largest of {len(nodes)} nodes (allocatable memory, {GPU_MEMORY_LABEL})",
    )


def _pod_capacity(
    pod: Mapping[str, Any], gpus: int, capacity: PodCapacity
) -> tuple[int | None, str]:
    if gpus:
        if capacity.gpu_bytes is None:
            return None, "unknown (give --gpu-memory, or nodes labelled nvidia.com/gpu.memory)"
        return gpus * capacity.gpu_bytes, f"{gpus} GPU x {capacity.source}"
    resources = pod["spec"]["containers"][0].get("resources", {})
    for kind in ("limits", "requests"):
        if "memory" in resources.get(kind, {}):
            value = resources[kind]["memory"]
            return parse_memory_quantity(value, field_path=f"resources.{kind}.memory"), (
                f"pod memory {kind} {value}"
            )
    if capacity.host_bytes is None:
        return None, "unknown (set resources.limits.memory, --node-memory or --kubeconfig)"
    return capacity.host_bytes, capacity.source


def _verdict(
    estimate: int | None, cap: int | None, headroom: float
) -> tuple[float | None, Verdict]:
    if estimate is None or cap is None or cap <= 0:
        return None, "unknown"
    left = (cap - estimate) / cap
    if left < 0:
        return left, "does-not-fit"
    return left, "tight" if left < headroom else "fits"


def matrix_algorithm(spec: RLJobSpec) -> str:
    """The matrix's algorithm label: ppo, grpo, dr-grpo or dapo."""
    if spec.algorithm.name == "grpo" and resolve_advantage_estimator(spec.algorithm) == "dr-grpo":
        return "dr-grpo"
    return spec.algorithm.name


def nearest_cell(
    spec: RLJobSpec, topology: ResolvedTopology, cells: Sequence[Mapping[str, Any]]
) -> NearestCell:
    """The measured cell with the fewest differences (algorithm, topology, maxVersions,
    correction). Near means same algorithm and topology; otherwise the plan says so."""
    if not cells:
        return NearestCell(False, None, [], "no measured matrix cells (bench/results/matrix.json)")
    want = {
        "algorithm": matrix_algorithm(spec),
        "topology": topology,
        "max_versions": spec.staleness.max_versions if topology == "disaggregated" else None,
        "correction": spec.staleness.correction,
    }
    weights = {"algorithm": 4, "topology": 4, "max_versions": 1, "correction": 1}

    def differences(cell: Mapping[str, Any]) -> list[str]:
        return [f"{k} {cell.get(k)} (job: {v})" for k, v in want.items() if cell.get(k) != v]

    def cost(cell: Mapping[str, Any]) -> int:
        return sum(weights[k] for k, v in want.items() if cell.get(k) != v)

    best = min(cells, key=cost)
    diff = differences(best)
    near = cost(best) < 4
    note = (
        "same cell measured"
        if not diff
        else ("nearest measured cell differs in " + "; ".join(diff))
    )
    if not near:
        note = "no measured cell is near this job: " + note
    return NearestCell(near, dict(best), diff, note)


def build_plan(
    job: RLJob,
    *,
    shape: ModelShape | None,
    capacity: PodCapacity,
    cells: Sequence[Mapping[str, Any]] = (),
    headroom: float = DEFAULT_HEADROOM,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> JobPlan:
    """The plan of one parsed job (see the module docstring)."""
    spec = job.spec
    topology, reason, path = decision_path(spec)
    fits, fit_reason = fit_verdict(spec, topology)
    ref = JobRef(
        name=job.metadata.name or "job", namespace=job.metadata.namespace or "default", uid=""
    )
    children = build_children(job, ref, topology, token="plan", restart_epochs={})
    pods: list[PodPlan] = []
    warnings: list[str] = []
    for pod in (o for o in children if o["kind"] == "Pod"):
        role = pod["metadata"]["labels"]["rljob.io/role"]
        gpus = role_gpus(spec, role)
        resources = pod["spec"]["containers"][0].get("resources", {})
        estimate = (
            None
            if shape is None
            else estimate_pod_memory(spec, topology, role, shape, prompt_tokens=prompt_tokens)
        )
        cap, source = _pod_capacity(pod, gpus, capacity)
        left, verdict = _verdict(None if estimate is None else estimate.total, cap, headroom)
        pods.append(
            PodPlan(
                pod["metadata"]["name"],
                role,
                gpus,
                dict(resources.get("requests", {})),
                dict(resources.get("limits", {})),
                estimate,
                cap,
                source,
                left,
                verdict,
            )
        )
        if verdict == "tight":
            warnings.append(
                f"{pod['metadata']['name']}: headroom {left:.0%} is below {headroom:.0%}; "
                "add memory or set spec.trainer.gradientCheckpointing"
            )
        if verdict == "does-not-fit":
            warnings.append(f"{pod['metadata']['name']}: the estimate exceeds {source}")
    if shape is None:
        warnings.append("no model config.json: memory not estimated (give --model DIR)")
    return JobPlan(
        name=ref.name,
        topology=topology,
        reason=reason,
        path=path,
        fits_algorithm=fits,
        fit_reason=fit_reason,
        pods=pods,
        headroom_required=headroom,
        nearest=nearest_cell(spec, topology, cells),
        warnings=warnings,
    )


# ------------------------------------------------------------------------------ rendering


def _gib(value: int | None) -> str:
    return (
        "?"
        if value is None
        else f"{value / GIB:.2f} GiB"
        if value >= GIB / 10
        else (f"{value / 2**20:.1f} MiB")
    )


def render_plan(plan: JobPlan) -> str:
    """The human-readable plan."""
    lines = [f"RLJob {plan.name}", f"topology: {plan.topology} ({plan.reason})", "decision path:"]
    for step in plan.path:
        fields = ", ".join(f"{k}={v}" for k, v in step.fields.items())
        mark = "-> decides" if step.matched else "-> no"
        lines.append(f"  rule {step.rule}: {step.text} [{fields}] {mark}")
    lines.append(f"fit: {'yes' if plan.fits_algorithm else 'no'}: {plan.fit_reason}")
    lines.append(f"pods ({len(plan.pods)}), headroom required {plan.headroom_required:.0%}:")
    for pod in plan.pods:
        res = f"gpus={pod.gpus} requests={pod.requests or {}} limits={pod.limits or {}}"
        lines.append(f"  {pod.name} [{pod.role}] {res}")
        if pod.memory is not None:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in pod.memory.components.items())
            lines.append(f"    memory: {parts}")
            if pod.memory.activations_full or pod.memory.activations_checkpointed:
                lines.append(
                    f"    activations: {_gib(pod.memory.activations_full)} without, "
                    f"{_gib(pod.memory.activations_checkpointed)} with gradient checkpointing "
                    f"({'on' if pod.memory.gradient_checkpointing else 'off'})"
                )
            lines.append(f"    estimate: {_gib(pod.memory.total)}")
        head = "?" if pod.headroom is None else f"{pod.headroom:.0%}"
        lines.append(
            f"    available: {_gib(pod.capacity_bytes)} ({pod.capacity_source}); "
            f"headroom {head}: {pod.verdict}"
        )
    lines.append(f"measured: {plan.nearest.note}")
    if plan.nearest.cell is not None:
        keys = ("samples_per_s", "final_reward_mean", "final_reward_spread", "mean_lag_versions")
        nums = ", ".join(f"{k} {plan.nearest.cell[k]}" for k in keys if k in plan.nearest.cell)
        lines.append(f"  cell {plan.nearest.cell.get('cell', '?')}: {nums}")
        if "measured_on" in plan.nearest.cell:
            lines.append(f"  measured on {plan.nearest.cell['measured_on']} (compare, not predict)")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append(f"verdict: {plan.verdict}")
    return "\n".join(lines) + "\n"


def build_plan_summary(job: RLJob, topology: ResolvedTopology) -> str:
    """What the operator records at creation: why this topology and each role's pods with their
    resources. The memory estimate needs the model's config.json, which the operator does not
    read; ``rljob plan --model`` gives it."""
    spec = job.spec
    _, reason, path = decision_path(spec)
    fits, fit_reason = fit_verdict(spec, topology)
    roles = ["actor"] if topology == "colocated" else ["rollout", "trainer"]
    parts = []
    for role in roles:
        replicas = spec.rollout.replicas if role == "rollout" else spec.trainer.replicas
        res = spec.rollout.resources if role == "rollout" else spec.trainer.resources
        mem = res.limits.get("memory") or res.requests.get("memory") or "unset"
        parts.append(
            f"{replicas}x {role} ({role_gpus(spec, role)} GPU, memory {mem})"  # type: ignore[arg-type]
        )
    return (
        f"topology {topology}: {reason} (rule {path[-1].rule}); "
        f"{'fits' if fits else 'does not fit'}: {fit_reason}; pods: {', '.join(parts)}; "
        "memory estimate per pod: rljob plan --model DIR"
    )
