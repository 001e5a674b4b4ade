"""``rljob plan``: what a job will run as and what it will cost, before anything runs.

Pure (no client, no clock, no file reads): the CLI reads the manifest, the model's
``config.json``, the nodes and the committed matrix results, and hands them in as values.

- ``decision_path``: the ``topology: auto`` rule (docs/concepts/algorithms.md), one step per
  rule, each naming the
  fields it looked at and whether it decided.
- ``estimate_rank_memory``: memory per rank, i.e. per GPU (never a pod's GPUs summed), modelled
  on what the trainer does: fp32 master parameters, fp32 gradients and two fp32 AdamW moments
  whatever ``model.dtype`` (the compute dtype), full on every rank under ddp or 1/world under
  fsdp (in host memory with cpuOffload, also on a single rank); FSDP's gathered compute-dtype
  parameters (two decoder layers and the root, or the whole model without reshardAfterForward)
  and unsharded gradients;
  the reference (klCoef > 0) in the compute dtype, sharded like the policy; the critic (gae) like
  the policy; the activations of the largest micro-batch (``microBatchTokens``) with one chunk of
  ``LOGIT_CHUNK_TOKENS`` tokens of fp32 logits, with and without gradient checkpointing; the
  engine's weights and KV cache for its share of the step's sequences.
- ``build_plan``: pods (from ``builders.build_children``, never rebuilt here), the per-rank
  estimate against one GPU (a vLLM rollout engine: its reserved share of one GPU; a CPU pod: its
  memory), host memory for cpuOffload, headroom verdict, fit verdict and the nearest measured
  cell of the algorithm × topology matrix (``bench/results/matrix.json``).
- ``build_plan_summary``: the short text the operator records at creation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from rljob_operator.api import (
    ResolvedTopology,
    RLJob,
    RLJobSpec,
    engines_per_replica,
    is_on_policy,
    processes_per_replica,
    resolve_advantage_estimator,
    resolve_sharding,
    resolve_topology,
    responses_per_prompt,
    tensor_parallel_size,
)
from rljob_operator.builders import JobRef, build_children, role_gpus
from rljob_workers.config import tensor_parallel_problem

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
    """Whether the algorithm fits the topology (docs/concepts/algorithms.md's fit table) and why."""
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

ENGINE_GPU_MEMORY_UTILIZATION = 0.5
"""Share of a GPU a colocated vLLM engine reserves unless ``spec.rollout.gpuMemoryUtilization``
says otherwise (a disaggregated engine: 0.9, see ``engine_memory_share``): its
weights and KV cache must fit in it, and beside a colocated trainer the rest is the trainer's."""
LOGIT_CHUNK_TOKENS = 1024
"""Tokens whose vocabulary-sized logits the trainer materialises at once: log-probabilities and
entropy are computed over the sequence in chunks of this many tokens (each chunk recomputed in the
backward pass), so a micro-batch never holds fp32 logits for all of its tokens."""
LOGIT_CHUNK_COPIES = 6
"""fp32 vocabulary-sized tensors per chunk token at the peak: the logits, the tempered logits,
their log-softmax, the softmax and its product with the logits (the entropy), and a gradient
(checked on an H200 with a 0.5B model, ``bench/gpu_check.py``: with 3 the estimate was 20% low)."""
FSDP_GATHERED_LAYERS = 2
"""Decoder layers whose full parameters FSDP holds at once with reshardAfterForward: the current
one and the prefetched next one."""
DDP_GRADIENT_BUCKETS = False
"""Whether DDP keeps its own flat copy of the gradients in its all-reduce buckets (4 more bytes
per parameter on every ddp rank of a group). It does not: the trainer sets
``gradient_as_bucket_view``, so the gradients are views into the buckets."""
FP32_BYTES = 4


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

    def embedding_parameters(self) -> int:
        """Parameters of the token embedding (also the LM head when tied)."""
        return self.vocab_size * self.hidden_size

    def root_parameters(self) -> int:
        """Parameters outside the decoder layers (embeddings, final norm, untied LM head): the
        FSDP root unit, gathered for the whole forward and backward."""
        head = 0 if self.tie_word_embeddings else self.embedding_parameters()
        return self.embedding_parameters() + self.hidden_size + head

    def parameters(self) -> int:
        """Parameters of the causal LM (embeddings, layers, final norm, untied LM head)."""
        return self.num_layers * self.layer_parameters() + self.root_parameters()

    def critic_root_parameters(self) -> int:
        """The value model's root: embeddings, final norm and a scalar head."""
        return self.embedding_parameters() + 2 * self.hidden_size + 1

    def critic_parameters(self) -> int:
        """Parameters of the value model: the backbone plus a scalar head."""
        return self.num_layers * self.layer_parameters() + self.critic_root_parameters()

    def autocast_parameters(self, *, critic: bool = False) -> int:
        """Parameters autocast copies to the compute dtype (every linear layer, the LM or value
        head included; embeddings and norms run in fp32)."""
        linears = self.num_layers * (self.layer_parameters() - 2 * self.hidden_size)
        head = self.hidden_size + 1 if critic else self.embedding_parameters()
        return linears + head


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer lays its models over its ranks (the worker's ``sharding.ShardingPlan``).

    ``sharding`` is what runs: fsdp needs a process group, i.e. two ranks or more, or one rank
    with cpuOffload (a group of one whose fp32 state FSDP2 keeps in host memory); one rank
    without cpuOffload keeps a full replica, as ddp does. ``cpu_offload`` applies to fsdp only.
    """

    sharding: Literal["fsdp", "ddp"]
    requested: str
    world: int
    ranks_per_pod: int
    reshard_after_forward: bool
    cpu_offload: bool
    micro_batch_tokens: int
    compute_bytes: int

    def describe(self) -> str:
        """One line: world, layout and its options."""
        if self.sharding == "ddp":
            how = "ddp (a full fp32 replica per rank)"
            if self.requested == "fsdp":
                how = "fsdp on 1 rank = a full fp32 replica (nothing to shard over)"
        elif self.world == 1:
            how = (
                "fsdp on 1 rank with cpuOffload (its fp32 state in host memory, "
                f"reshardAfterForward {str(self.reshard_after_forward).lower()})"
            )
        else:
            how = (
                f"fsdp (fp32 state 1/{self.world} per rank, "
                f"reshardAfterForward {str(self.reshard_after_forward).lower()}, "
                f"cpuOffload {str(self.cpu_offload).lower()})"
            )
        return (
            f"trainer world {self.world} rank(s) ({self.ranks_per_pod} per pod), {how}, "
            f"micro-batches of at most {self.micro_batch_tokens} tokens"
        )


def ranks_per_pod(spec: RLJobSpec) -> int:
    """Trainer ranks per trainer/actor pod: ``processesPerReplica``, one per GPU by default.
    Every estimate is per rank, i.e. per GPU: a pod's GPUs are never summed."""
    return processes_per_replica(spec.trainer)


def engine_tensor_parallel(spec: RLJobSpec, role: str) -> int:
    """GPUs one engine of ``role`` spans (vLLM tensor parallel): a colocated actor's engine 1."""
    return tensor_parallel_size(spec.rollout) if role == "rollout" else 1


def engines_of(spec: RLJobSpec, role: str) -> int:
    """Engines of ``role`` in the whole job: one per actor rank, or per rollout engine."""
    if role == "rollout":
        return spec.rollout.replicas * engines_per_replica(spec.rollout)
    return spec.trainer.replicas * ranks_per_pod(spec)


def engine_memory_share(spec: RLJobSpec, role: str) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine of ``role`` (the worker's default)."""
    if spec.rollout.gpu_memory_utilization is not None:
        return spec.rollout.gpu_memory_utilization
    return ENGINE_GPU_MEMORY_UTILIZATION if role == "actor" else 0.9


def trainer_layout(spec: RLJobSpec) -> TrainerLayout:
    """The layout ``spec.trainer`` asks for, as the trainer will run it."""
    trainer = spec.trainer
    ranks = ranks_per_pod(spec)
    world = trainer.replicas * ranks
    requested = resolve_sharding(trainer)
    fsdp = requested == "fsdp" and (world > 1 or trainer.cpu_offload)
    return TrainerLayout(
        sharding="fsdp" if fsdp else "ddp",
        requested=requested,
        world=world,
        ranks_per_pod=ranks,
        reshard_after_forward=trainer.reshard_after_forward,
        cpu_offload=fsdp and trainer.cpu_offload,
        micro_batch_tokens=trainer.micro_batch_tokens,
        compute_bytes=DTYPE_BYTES[spec.model.dtype],
    )


def model_state_bytes(
    params: int, *, world: int, sharded: bool, trainable: bool = True, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes one rank holds of a model's parameters, gradients and optimizer state (the keys of
    the worker's ``sharding.local_state_bytes``). Trainable: fp32 master parameters, fp32
    gradients and two fp32 AdamW moments, whatever the compute dtype. Frozen (the reference):
    parameters in ``dtype_bytes`` only. Sharded: ``ceil(params / world)`` of each."""
    local = math.ceil(params / world) if sharded else params
    if not trainable:
        return {"parameters": local * dtype_bytes, "gradients": 0, "optimizer": 0}
    return {
        "parameters": FP32_BYTES * local,
        "gradients": FP32_BYTES * local,
        "optimizer": 2 * FP32_BYTES * local,
    }


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank (one GPU; a CPU pod's one process) needs, by phase.

    - ``components``: held for the whole step (sharded or replicated model state, reference);
    - ``transient``: held only during a forward/backward (FSDP's gathered parameters and unsharded
      gradients; autocast's compute-dtype weight copies under ddp), plus the activations of one
      micro-batch (``activations_full``, or ``activations_checkpointed`` with gradient
      checkpointing);
    - ``generation``: held only while a colocated GPU actor generates (its engine sleeps while it
      trains, so this phase and the training phase never overlap);
    - ``host``: per rank in host memory (FSDP CPU offload), never on the GPU.

    ``total`` is the peak on the rank's device: held + the larger of the two phases.
    """

    components: dict[str, int]
    activations_full: int
    activations_checkpointed: int
    gradient_checkpointing: bool
    transient: dict[str, int] = field(default_factory=dict)
    generation: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    layout: TrainerLayout | None = None

    def _peak(self, activations: int) -> int:
        training = sum(self.transient.values()) + activations
        return sum(self.components.values()) + max(training, sum(self.generation.values()))

    @property
    def total(self) -> int:
        """Peak device bytes per rank with the job's gradient-checkpointing setting."""
        act = (
            self.activations_checkpointed if self.gradient_checkpointing else self.activations_full
        )
        return self._peak(act)

    @property
    def total_other_setting(self) -> int:
        """The total with gradient checkpointing flipped (what turning it on/off would give)."""
        act = (
            self.activations_full if self.gradient_checkpointing else self.activations_checkpointed
        )
        return self._peak(act)

    @property
    def host_total(self) -> int:
        """Host bytes per rank (CPU offload)."""
        return sum(self.host.values())


def activation_bytes(
    shape: ModelShape, *, tokens: int, dtype_bytes: int, checkpointed: bool, logits: bool = True
) -> int:
    """Activation memory of one micro-batch of ``tokens`` tokens kept for backward, in the
    compute dtype (SDPA attention, so no seq×seq score matrix is stored). Per layer and token:
    ~8 hidden-sized tensors (norm inputs, q/k/v/o inputs and outputs, residuals), 2 kv-sized and
    4 intermediate-sized (gate, up, act, product). Checkpointing keeps only each layer's input
    plus one recomputed layer. Either way the backward pass holds one layer's activation
    gradients at a time. ``logits``: plus one chunk of ``LOGIT_CHUNK_TOKENS`` tokens of
    vocabulary-sized fp32 logits, ``LOGIT_CHUNK_COPIES`` times (the value model has none)."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    per_layer = tokens * (8 * h + 2 * kv + 4 * shape.intermediate_size) * dtype_bytes
    chunk = min(tokens, LOGIT_CHUNK_TOKENS)
    head = chunk * shape.vocab_size * FP32_BYTES * LOGIT_CHUNK_COPIES if logits else 0
    backward = per_layer
    if checkpointed:
        return shape.num_layers * tokens * h * dtype_bytes + per_layer + backward + head
    return shape.num_layers * per_layer + backward + head


def micro_batch_tokens(spec: RLJobSpec, layout: TrainerLayout, *, seq_len: int) -> int:
    """Tokens in the largest micro-batch of a rank: its share of a minibatch's rows (padded to
    ``seq_len``), capped at ``spec.trainer.microBatchTokens`` (a row longer than the budget is a
    micro-batch of its own)."""
    algo = spec.algorithm
    rows = max(
        1,
        math.ceil(
            (algo.mini_batch_size or algo.batch_size) * responses_per_prompt(spec) / layout.world
        ),
    )
    return min(rows * seq_len, max(layout.micro_batch_tokens, seq_len))


def kv_cache_bytes(shape: ModelShape, *, sequences: int, seq_len: int, dtype_bytes: int) -> int:
    """KV cache for ``sequences`` concurrent sequences of ``seq_len`` tokens."""
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
    return per_token * sequences * seq_len


@dataclass(frozen=True)
class _Trained:
    held: dict[str, int]
    transient: dict[str, int]


def _trained_model(
    name: str, params: int, layer: int, root: int, autocast: int, layout: TrainerLayout
) -> _Trained:
    """A trained model (policy or critic) on one rank: fp32 state, and what a forward/backward
    adds (see ``MemoryEstimate``)."""
    fsdp = layout.sharding == "fsdp"
    state = model_state_bytes(params, world=layout.world, sharded=fsdp)
    held = {
        f"{name}_parameters_fp32": state["parameters"],
        f"{name}_gradients_fp32": state["gradients"],
        f"{name}_adam_moments_fp32": state["optimizer"],
    }
    c = layout.compute_bytes
    transient: dict[str, int] = {}
    if not fsdp:
        if layout.world > 1 and DDP_GRADIENT_BUCKETS:
            held[f"{name}_ddp_gradient_buckets_fp32"] = FP32_BYTES * params
        if c < FP32_BYTES:
            transient[f"{name}_autocast_weights"] = autocast * c
        return _Trained(held, transient)
    gathered = root + FSDP_GATHERED_LAYERS * layer if layout.reshard_after_forward else params
    transient[f"{name}_gathered_parameters"] = gathered * c
    # the root's gradients in the compute dtype until the end of backward, and one layer's
    # gradients in fp32 on their way into the reduce-scatter
    transient[f"{name}_unsharded_gradients"] = root * c + layer * FP32_BYTES
    return _Trained(held, transient)


def _trainer_rank(
    spec: RLJobSpec, shape: ModelShape, *, seq_len: int
) -> tuple[dict[str, int], dict[str, int], dict[str, int], int, int, TrainerLayout]:
    """Held, transient and host bytes and both activation figures of one trainer rank."""
    layout = trainer_layout(spec)
    c = layout.compute_bytes
    layer = shape.layer_parameters()
    policy = _trained_model(
        "policy",
        shape.parameters(),
        layer,
        shape.root_parameters(),
        shape.autocast_parameters(),
        layout,
    )
    held = dict(policy.held)
    transient = policy.transient
    if spec.algorithm.kl_coef > 0:
        ref = model_state_bytes(
            shape.parameters(),
            world=layout.world,
            sharded=layout.sharding == "fsdp",
            trainable=False,
            dtype_bytes=c,
        )
        held["reference_parameters"] = ref["parameters"]
    if resolve_advantage_estimator(spec.algorithm) == "gae":
        critic = _trained_model(
            "critic",
            shape.critic_parameters(),
            layer,
            shape.critic_root_parameters(),
            shape.autocast_parameters(critic=True),
            layout,
        )
        held.update(critic.held)
        # the critic steps before the policy: its transients are never held with the policy's
        if sum(critic.transient.values()) > sum(transient.values()):
            transient = critic.transient
    host: dict[str, int] = {}
    if layout.cpu_offload:
        host, held = held, {}
    tokens = micro_batch_tokens(spec, layout, seq_len=seq_len)
    # the value model's activations (no logits) are never larger than the policy's
    full, checkpointed = (
        activation_bytes(shape, tokens=tokens, dtype_bytes=c, checkpointed=flag)
        for flag in (False, True)
    )
    return held, dict(transient), host, full, checkpointed, layout


def estimate_rank_memory(
    spec: RLJobSpec,
    topology: ResolvedTopology,
    role: str,
    shape: ModelShape,
    *,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> MemoryEstimate:
    """Memory one rank of ``role`` needs: one GPU (or a CPU pod's process), never a pod's GPUs
    summed. Trainer ranks: the policy's (and critic's) fp32 state, full under ddp or 1/world
    under fsdp (in host memory with cpuOffload), the reference in the compute dtype, what one
    forward/backward of the largest micro-batch adds. Engines: weights and the KV cache for the
    engine's share of the step's sequences."""
    b = DTYPE_BYTES[spec.model.dtype]
    seq_len = prompt_tokens + spec.rollout.sampling.max_tokens
    components: dict[str, int] = {}
    transient: dict[str, int] = {}
    host: dict[str, int] = {}
    full = checkpointed = 0
    layout = None
    if role in ("actor", "trainer"):
        components, transient, host, full, checkpointed, layout = _trainer_rank(
            spec, shape, seq_len=seq_len
        )
    generation: dict[str, int] = {}
    if role in ("actor", "rollout"):
        engines = engines_of(spec, role)
        tp = engine_tensor_parallel(spec, role)
        n = responses_per_prompt(spec)
        sequences = max(1, math.ceil(spec.algorithm.batch_size * n / engines))
        engine = {  # one GPU's shard of the engine
            "engine_weights": math.ceil(shape.parameters() * b / tp),
            "kv_cache": math.ceil(
                kv_cache_bytes(shape, sequences=sequences, seq_len=seq_len, dtype_bytes=b) / tp
            ),
        }
        # a GPU actor's engine sleeps while it trains; on CPU sleep frees nothing
        if role == "actor" and role_gpus(spec, "actor") > 0:
            generation = engine
        else:
            components.update(engine)
    return MemoryEstimate(
        components,
        full,
        checkpointed,
        spec.trainer.gradient_checkpointing,
        transient=transient,
        generation=generation,
        host=host,
        layout=layout,
    )


# --------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PodPlan:
    """One pod the operator would create, with the estimate for one of its ranks (one GPU, or a
    CPU pod's one process) against what that rank can use, and the pod's host memory where its
    ranks keep state there (cpuOffload)."""

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
    gpus_used: int = 0
    ranks: int = 1
    tensor_parallel: int = 1
    host_bytes: int | None = None
    host_capacity_bytes: int | None = None
    host_capacity_source: str = ""
    host_headroom: float | None = None


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
        """A JSON-ready dict (``--output json``); memory totals are per rank (one GPU)."""
        out = asdict(self)
        out["verdict"] = self.verdict
        for pod, plan in zip(out["pods"], self.pods, strict=True):
            if plan.memory is not None:
                pod["memory"]["totalBytes"] = plan.memory.total
                pod["memory"]["totalBytesOtherCheckpointing"] = plan.memory.total_other_setting
                pod["memory"]["hostBytes"] = plan.memory.host_total
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


def _host_capacity(pod: Mapping[str, Any], capacity: PodCapacity) -> tuple[int | None, str]:
    """The host memory a pod is sure of: its limit, else its request, else the nodes'."""
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


def _rank_capacity(
    pod: Mapping[str, Any], spec: RLJobSpec, role: str, gpus: int, capacity: PodCapacity
) -> tuple[int | None, str]:
    """What one rank can use: one GPU (never the pod's GPUs summed; a vLLM rollout engine only
    its reserved share of it), or a CPU pod's memory."""
    engine = spec.rollout.engine
    if not gpus:
        return _host_capacity(pod, capacity)
    if capacity.gpu_bytes is None:
        return None, "unknown (give --gpu-memory, or nodes labelled nvidia.com/gpu.memory)"
    which = "one GPU" if gpus == 1 else f"one of the pod's {gpus} GPUs"
    if role == "rollout" and engine == "vllm":
        utilization = engine_memory_share(spec, role)
        share = int(utilization * capacity.gpu_bytes)
        return share, f"vLLM's gpu_memory_utilization {utilization} of {which}: {capacity.source}"
    return capacity.gpu_bytes, f"{which}: {capacity.source}"


def _verdict(
    estimate: int | None, cap: int | None, headroom: float
) -> tuple[float | None, Verdict]:
    if estimate is None or cap is None or cap <= 0:
        return None, "unknown"
    left = (cap - estimate) / cap
    if left < 0:
        return left, "does-not-fit"
    return left, "tight" if left < headroom else "fits"


_SEVERITY: dict[Verdict, int] = {"fits": 0, "unknown": 1, "tight": 2, "does-not-fit": 3}


def _worst(*verdicts: Verdict) -> Verdict:
    return max(verdicts, key=_SEVERITY.__getitem__)


def _gpus_used(role: str, spec: RLJobSpec) -> int:
    """GPUs of a pod that its processes use: one per trainer rank, or tensorParallelSize per
    rollout engine."""
    gpus = role_gpus(spec, role)  # type: ignore[arg-type]
    if role == "rollout":
        return min(gpus, engines_per_replica(spec.rollout) * tensor_parallel_size(spec.rollout))
    return min(gpus, ranks_per_pod(spec))


def _layout_warnings(spec: RLJobSpec, roles: set[str]) -> list[str]:
    """Once per role: GPUs a pod asks for but leaves idle (fewer processes or engines than its
    GPUs, as set explicitly)."""
    warnings: list[str] = []
    for role in sorted(roles):
        gpus, used = role_gpus(spec, role), _gpus_used(role, spec)  # type: ignore[arg-type]
        if gpus <= used:
            continue
        if role == "rollout":
            engines, tp = engines_per_replica(spec.rollout), tensor_parallel_size(spec.rollout)
            warnings.append(
                f"spec.rollout.enginesPerReplica {engines} x tensorParallelSize {tp} use {used} "
                f"of each rollout pod's {gpus} GPUs; {gpus - used} stay idle (remove "
                "enginesPerReplica: gpusPerReplica / tensorParallelSize engines)"
            )
            continue
        warnings.append(
            f"spec.trainer.processesPerReplica {used}: each {role} pod runs {used} trainer "
            f"process(es) on {used} of its {gpus} GPUs; {gpus - used} stay idle (remove "
            "processesPerReplica: one process per GPU)"
        )
    return warnings


def _heads_check(name: str, spec: RLJobSpec, role: str, shape: ModelShape | None) -> list[str]:
    """A rollout engine's tensor-parallel size against the model's heads (vLLM's rule)."""
    if shape is None or role != "rollout":
        return []
    problem = tensor_parallel_problem(
        {"num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads},
        tensor_parallel_size(spec.rollout),
    )
    return [f"{name}: {problem}"] if problem else []


def _engine_check(
    name: str, est: MemoryEstimate, gpu_bytes: int | None, utilization: float
) -> tuple[Verdict, list[str]]:
    """A colocated GPU actor's vLLM engine: it reserves its share of the GPU beside the trainer
    state held while it generates, and its weights and KV cache must fit that share."""
    if gpu_bytes is None or not est.generation:
        return "fits", []
    share = int(utilization * gpu_bytes)
    need, held = sum(est.generation.values()), sum(est.components.values())
    problems = []
    if need > share:
        problems.append(
            f"{name}: the vLLM engine needs {_gib(need)} (weights + KV cache) but reserves "
            f"gpu_memory_utilization {utilization} of the GPU, {_gib(share)}"
        )
    if held + share > gpu_bytes:
        problems.append(
            f"{name}: the trainer state held while generating ({_gib(held)}) plus the vLLM "
            f"engine's share ({_gib(share)}) exceed one GPU ({_gib(gpu_bytes)})"
        )
    return ("does-not-fit" if problems else "fits"), problems


def _plan_pod(
    pod: Mapping[str, Any],
    spec: RLJobSpec,
    topology: ResolvedTopology,
    shape: ModelShape | None,
    capacity: PodCapacity,
    headroom: float,
    prompt_tokens: int,
) -> tuple[PodPlan, list[str]]:
    name = pod["metadata"]["name"]
    role = pod["metadata"]["labels"]["rljob.io/role"]
    gpus = role_gpus(spec, role)
    resources = pod["spec"]["containers"][0].get("resources", {})
    est = (
        None
        if shape is None
        else estimate_rank_memory(spec, topology, role, shape, prompt_tokens=prompt_tokens)
    )
    cap, source = _rank_capacity(pod, spec, role, gpus, capacity)
    device = None if est is None else est.total + (0 if gpus else est.host_total)
    left, verdict = _verdict(device, cap, headroom)
    warnings = []
    if verdict == "tight":
        warnings.append(
            f"{name}: headroom {left:.0%} is below {headroom:.0%} on one rank (GPU); "
            "add memory or set spec.trainer.gradientCheckpointing"
        )
    if verdict == "does-not-fit":
        warnings.append(f"{name}: the per-rank estimate exceeds {source}")
    ranks = (
        ranks_per_pod(spec) if role in ("actor", "trainer") else engines_per_replica(spec.rollout)
    )
    host_bytes = host_cap = host_left = None
    host_source = ""
    if est is not None and est.host and gpus:
        host_bytes = ranks * est.host_total
        host_cap, host_source = _host_capacity(pod, capacity)
        host_left, host_verdict = _verdict(host_bytes, host_cap, headroom)
        if host_verdict in ("does-not-fit", "unknown"):
            warnings.append(
                f"{name}: cpuOffload keeps {_gib(host_bytes)} in host memory, against "
                f"{host_source}; set spec.trainer.resources.limits.memory to what the node gives"
            )
        verdict = _worst(verdict, host_verdict)
    if est is not None and gpus and spec.rollout.engine == "vllm":
        engine_verdict, problems = _engine_check(
            name, est, capacity.gpu_bytes, engine_memory_share(spec, role)
        )
        verdict, warnings = _worst(verdict, engine_verdict), warnings + problems
    heads = _heads_check(name, spec, role, shape)
    if heads:
        verdict, warnings = "does-not-fit", warnings + heads
    plan = PodPlan(
        name=name,
        role=role,
        gpus=gpus,
        requests=dict(resources.get("requests", {})),
        limits=dict(resources.get("limits", {})),
        memory=est,
        capacity_bytes=cap,
        capacity_source=source,
        headroom=left,
        verdict=verdict,
        gpus_used=_gpus_used(role, spec),
        ranks=ranks,
        tensor_parallel=engine_tensor_parallel(spec, role),
        host_bytes=host_bytes,
        host_capacity_bytes=host_cap,
        host_capacity_source=host_source,
        host_headroom=host_left,
    )
    return plan, warnings


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
    planned = [
        _plan_pod(pod, spec, topology, shape, capacity, headroom, prompt_tokens)
        for pod in children
        if pod["kind"] == "Pod"
    ]
    pods = [pod for pod, _ in planned]
    notes = {pod.name: pod_notes for pod, pod_notes in planned}
    warnings = _layout_warnings(spec, {p.role for p in pods})
    for group in _same_pods(pods):  # identical pods: one warning naming the run
        first, last = group[0].name, group[-1].name
        names = first if first == last else f"{first} .. {last}"
        warnings += [note.replace(first, names, 1) for note in notes[first]]
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


def _parts(values: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {_gib(v)}" for k, v in values.items())


def _render_memory(pod: PodPlan) -> list[str]:
    mem = pod.memory
    if mem is None:
        return []
    lines = []
    if mem.layout is not None:
        lines.append(f"    {mem.layout.describe()}")
    unit = "per rank (GPU)" if pod.gpus else "per rank (the pod's process)"
    if pod.gpus > pod.gpus_used:
        lines.append(f"    uses {pod.gpus_used} of the pod's {pod.gpus} GPUs; figures {unit}")
    if mem.components:
        lines.append(f"    held {unit}: {_parts(mem.components)}")
    if mem.transient or mem.activations_full:
        lines.append(f"    during forward/backward {unit}: {_parts(mem.transient) or '-'}")
        lines.append(
            f"    activations of one micro-batch: {_gib(mem.activations_full)} without, "
            f"{_gib(mem.activations_checkpointed)} with gradient checkpointing "
            f"({'on' if mem.gradient_checkpointing else 'off'})"
        )
    if mem.generation:
        lines.append(
            f"    while generating (engine asleep while training): {_parts(mem.generation)}"
        )
    if mem.host:
        lines.append(f"    host memory per rank (cpuOffload): {_parts(mem.host)}")
    lines.append(f"    estimate {unit}: {_gib(mem.total + (0 if pod.gpus else mem.host_total))}")
    return lines


def _same_pods(pods: Sequence[PodPlan]) -> list[list[PodPlan]]:
    """Runs of consecutive pods that differ only in name (one block of output each)."""
    groups: list[list[PodPlan]] = []
    for pod in pods:
        if groups and replace(groups[-1][0], name=pod.name) == pod:
            groups[-1].append(pod)
        else:
            groups.append([pod])
    return groups


def render_plan(plan: JobPlan) -> str:
    """The human-readable plan."""
    lines = [f"RLJob {plan.name}", f"topology: {plan.topology} ({plan.reason})", "decision path:"]
    for step in plan.path:
        fields = ", ".join(f"{k}={v}" for k, v in step.fields.items())
        mark = "-> decides" if step.matched else "-> no"
        lines.append(f"  rule {step.rule}: {step.text} [{fields}] {mark}")
    lines.append(f"fit: {'yes' if plan.fits_algorithm else 'no'}: {plan.fit_reason}")
    lines.append(
        f"pods ({len(plan.pods)}), memory per rank (GPU), headroom required "
        f"{plan.headroom_required:.0%}:"
    )
    for group in _same_pods(plan.pods):
        pod = group[0]
        res = f"gpus={pod.gpus} requests={pod.requests or {}} limits={pod.limits or {}}"
        names = pod.name if len(group) == 1 else f"{pod.name} .. {group[-1].name} (each)"
        lines.append(f"  {names} [{pod.role}] {res}")
        if pod.role == "rollout":
            lines.append(
                f"    engines: {pod.ranks} per pod, tensor parallel {pod.tensor_parallel} "
                f"(each GPU holds 1/{pod.tensor_parallel} of an engine's weights and KV cache)"
            )
        lines += _render_memory(pod)
        head = "?" if pod.headroom is None else f"{pod.headroom:.0%}"
        lines.append(
            f"    available per rank: {_gib(pod.capacity_bytes)} ({pod.capacity_source}); "
            f"headroom {head}"
        )
        if pod.host_bytes is not None:
            host_head = "?" if pod.host_headroom is None else f"{pod.host_headroom:.0%}"
            lines.append(
                f"    host memory of the pod: {_gib(pod.host_bytes)} of "
                f"{_gib(pod.host_capacity_bytes)} ({pod.host_capacity_source}); "
                f"headroom {host_head}"
            )
        lines.append(f"    pod: {pod.verdict}")
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
        "memory estimate per rank (GPU): rljob plan --model DIR"
    )
