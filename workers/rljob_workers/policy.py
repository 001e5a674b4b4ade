"""The training side of RL: the policy (a Hugging Face causal LM) and the PPO critic.

Sequences are laid out the way the losses expect them (``B`` sequences, ``T`` response tokens):
prompts are left-padded to a common length ``P`` and responses right-padded to ``T``, so
response token ``t`` of every row sits in column ``P + t`` and its log-probability comes from
the logits in column ``P + t - 1``. Position ids skip the left padding, so a padded row scores
exactly like the same row alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Size, Tensor, nn
from torch.utils.checkpoint import checkpoint

from rljob_workers.algos import entropy_from_logits
from rljob_workers.algos.sampling import Truncation
from rljob_workers.sharding import gather_full_tensors, global_amax

__all__ = [
    "LOGIT_CHUNK_TOKENS",
    "FloatRow",
    "IdRow",
    "PolicyModel",
    "SequenceBatch",
    "ValueModel",
    "build_sequence_batch",
    "load_causal_lm",
    "pad_rows",
    "pad_token_id",
    "split_micro_batches",
]

IdRow = Sequence[int] | npt.NDArray[np.integer[Any]]
"""One row of token ids: a list (an engine's output) or an integer array (a ``Trajectory``)."""
FloatRow = Sequence[float] | npt.NDArray[np.floating[Any]]
"""One row of log-probs: a list or a float array."""

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Weights are gathered from the shards in buckets of this size (``weightSync.bucketMiB``)."""
LOGIT_CHUNK_TOKENS = 1024
"""Tokens whose vocabulary-sized fp32 logits exist at once in a forward or backward pass."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class SequenceBatch:
    """Prompt + response token ids, padded for one forward pass.

    Attributes:
        input_ids: ``[B, P + T]`` left-padded prompts followed by right-padded responses.
        attention_mask: ``[B, P + T]``, 1 for real tokens.
        position_ids: ``[B, P + T]``, counting real tokens only.
        response_mask: ``[B, T]``, 1 for real response tokens.
        prompt_width: ``P``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    prompt_width: int

    @property
    def response_ids(self) -> Tensor:
        """``[B, T]`` response token ids (pad id where ``response_mask`` is 0)."""
        return self.input_ids[:, self.prompt_width :]

    def rows(self, index: Tensor | slice) -> SequenceBatch:
        """The sub-batch of the selected rows (same padding widths)."""
        return SequenceBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index],
            response_mask=self.response_mask[index],
            prompt_width=self.prompt_width,
        )

    def compact(self) -> SequenceBatch:
        """The same rows without the columns that are padding in every row (left of the
        longest prompt, right of the longest response; at least one response column)."""
        real = self.attention_mask.sum(dim=0) > 0
        left = int(real[: self.prompt_width].long().argmax()) if bool(real.any()) else 0
        lengths = self.response_mask.sum(dim=1)
        width_t = max(1, int(lengths.max())) if lengths.numel() else 1
        end = self.prompt_width + width_t
        return SequenceBatch(
            input_ids=self.input_ids[:, left:end],
            attention_mask=self.attention_mask[:, left:end],
            position_ids=self.position_ids[:, left:end],
            response_mask=self.response_mask[:, :width_t],
            prompt_width=self.prompt_width - left,
        )


def split_micro_batches(batch: SequenceBatch, token_budget: int | None) -> list[Tensor]:
    """Row indices of micro-batches of at most ``token_budget`` padded tokens each.

    Rows are packed by length (longest first, greedily), so each micro-batch pads to little
    more than its own rows; a row longer than the budget is a micro-batch of its own. None (or
    a batch within the budget) gives one micro-batch of every row, in order.
    """
    rows = int(batch.input_ids.shape[0])
    everything = torch.arange(rows)
    if token_budget is None or rows == 0:
        return [everything] if rows else []
    prompt = batch.attention_mask[:, : batch.prompt_width].sum(dim=1)
    response = batch.response_mask.sum(dim=1).long()
    if rows * int(prompt.max() + response.clamp(min=1).max()) <= token_budget:
        return [everything]
    order = sorted(range(rows), key=lambda r: (-int(prompt[r] + response[r]), r))
    groups: list[list[int]] = []
    widest_p = widest_t = 0
    for row in order:
        p, t = int(prompt[row]), max(1, int(response[row]))
        if groups and (len(groups[-1]) + 1) * (max(widest_p, p) + max(widest_t, t)) <= token_budget:
            groups[-1].append(row)
            widest_p, widest_t = max(widest_p, p), max(widest_t, t)
            continue
        groups.append([row])
        widest_p, widest_t = p, t
    return [torch.tensor(sorted(group)) for group in groups]


def build_sequence_batch(
    prompt_ids: Sequence[IdRow],
    response_ids: Sequence[IdRow],
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> SequenceBatch:
    """Pad ``B`` prompts (left) and their responses (right) into one ``SequenceBatch``.

    An empty response is allowed (its row of ``response_mask`` is all 0); at least one response
    token is laid out (``T >= 1``) so shapes stay valid. Rows are copied into preallocated
    arrays whole (lists and arrays alike), never token by token in Python.
    """
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(
            f"need as many prompts as responses (>= 1), got {len(prompt_ids)} and "
            f"{len(response_ids)}"
        )
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (e.g. the BOS token)")
    width_p = max(len(p) for p in prompt_ids)
    width_t = max(1, max(len(r) for r in response_ids))
    rows = len(prompt_ids)
    input_ids = np.full((rows, width_p + width_t), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width_p + width_t), dtype=np.int64)
    response_mask = np.zeros((rows, width_t), dtype=np.float32)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        left, right = width_p - len(prompt), width_p + len(response)
        input_ids[row, left:width_p] = prompt
        input_ids[row, width_p:right] = response
        attention[row, left:right] = 1
        response_mask[row, : len(response)] = 1.0
    attention_mask = torch.from_numpy(attention).to(device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return SequenceBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=torch.from_numpy(response_mask).to(device),
        prompt_width=width_p,
    )


def pad_rows(rows: Sequence[FloatRow], width: int) -> Tensor:
    """``[B, width]`` float32 rows, right-padded with zeros (longer rows are cut at ``width``)."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        clipped = row[:width]
        out[i, : len(clipped)] = clipped
    return torch.from_numpy(out)


def pad_token_id(tokenizer_path: str) -> int:
    """The tokenizer's pad id (its eos id when it has no pad token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


def load_causal_lm(path: str | Path, *, dtype: str = "float32", device: str = "cpu") -> Any:
    """Load a local Hugging Face causal LM (never downloads: ``local_files_only``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], local_files_only=True
    )
    nn.Module.to(model, device)
    return model


def disable_dropout(module: nn.Module) -> None:
    """Zero every dropout of ``module``: ``nn.Dropout`` layers, float ``*dropout`` attributes of
    its submodules (Qwen2 and Llama attention read ``attention_dropout`` in train mode only) and
    of a Hugging Face config.

    RL post-training runs without dropout, as verl and OpenRLHF do: the update's forward (train
    mode, where gradient checkpointing works) then computes exactly the log-probs of the
    no-gradient passes and the engine (eval mode), so the importance ratio starts at 1 and
    clipping measures policy change, not dropout noise.
    """
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
        for name, value in vars(sub).items():
            if name.endswith("dropout") and isinstance(value, float):
                setattr(sub, name, 0.0)
        config = getattr(sub, "config", None)
        for name, value in (vars(config) if config is not None else {}).items():
            if name.endswith("dropout") and isinstance(value, float):
                setattr(config, name, 0.0)


def _response_slice(batch: SequenceBatch, full: Tensor) -> Tensor:
    """Columns ``P - 1 .. P + T - 2`` of ``full [B, P + T, ...]``: the ones predicting responses."""
    width_t = batch.response_mask.shape[1]
    return full[:, batch.prompt_width - 1 : batch.prompt_width - 1 + width_t]


class PolicyModel(nn.Module):
    """A causal LM that scores response tokens: log-probs, entropy, weights for the engine.

    Args:
        model: a Hugging Face ``*ForCausalLM`` module.
        temperature: logits are divided by it before the softmax, matching sampling.
        truncation: the sampling's top-k / top-p / min-p restriction, applied after the
            temperature as the engines apply it (``algos.sampling``), with the scored token
            always kept: log-probs, entropies and gradients are those of the distribution the
            engine sampled from, not of the full softmax.
    """

    def __init__(
        self, model: Any, *, temperature: float = 1.0, truncation: Truncation | None = None
    ) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        disable_dropout(model)
        self.model = model
        self.temperature = temperature
        self.truncation = truncation or Truncation()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        truncation: Truncation | None = None,
        gradient_checkpointing: bool = False,
    ) -> PolicyModel:
        """Load the policy from a local checkpoint directory."""
        policy = cls(
            load_causal_lm(path, dtype=dtype, device=device),
            temperature=temperature,
            truncation=truncation,
        )
        policy.set_gradient_checkpointing(gradient_checkpointing)
        return policy

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute activations in the backward pass (less memory, ~30% more compute)."""
        if enabled:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            self.model.config.use_cache = False
        elif getattr(self.model, "is_gradient_checkpointing", False):
            self.model.gradient_checkpointing_disable()

    @property
    def vocab_size(self) -> int:
        """Token ids this policy can score are ``[0, vocab_size)``: its embedding's rows (an id
        past them fails the forward pass; the experience server refuses such trajectories)."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether activation recomputation is on."""
        return bool(getattr(self.model, "is_gradient_checkpointing", False))

    def forward(
        self, batch: SequenceBatch, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of the response tokens.

        Only the response positions go through the LM head, in chunks of at most
        ``LOGIT_CHUNK_TOKENS`` tokens whose fp32 logits are recomputed in the backward pass
        instead of kept, so a micro-batch never holds vocabulary-sized fp32 logits for all of
        its tokens. Models whose head scales or caps its logits take the plain path.

        Returns:
            ``(logp [B, T], entropy [B, T] or None)``; both 0 at padded positions.
        """
        if self._plain_head:
            return self._forward_full_logits(batch, with_entropy=with_entropy)
        out = self.model.get_decoder()(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        hidden = _response_slice(batch, out.last_hidden_state)
        targets = batch.response_ids
        rows, width = targets.shape
        step = max(1, LOGIT_CHUNK_TOKENS // max(rows, 1))
        logps: list[Tensor] = []
        entropies: list[Tensor] = []
        for start in range(0, width, step):
            part = (hidden[:, start : start + step], targets[:, start : start + step])
            if torch.is_grad_enabled():
                logp, entropy = checkpoint(
                    self._score_chunk, *part, with_entropy, use_reentrant=False
                )
            else:
                logp, entropy = self._score_chunk(*part, with_entropy)
            logps.append(logp)
            entropies.append(entropy)
        mask = batch.response_mask
        logp_all = torch.cat(logps, dim=1) * mask
        return logp_all, (torch.cat(entropies, dim=1) * mask if with_entropy else None)

    def _score_chunk(
        self, hidden: Tensor, targets: Tensor, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        # contiguous: a strided input can take another matmul kernel (last-bit differences
        # between a trainable policy and its frozen reference)
        logits = self.model.get_output_embeddings()(hidden.contiguous()).float() / self.temperature
        logits = self.truncation.apply(logits, keep=targets)
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = entropy_from_logits(logits) if with_entropy else torch.zeros_like(logp)
        return logp, entropy

    @property
    def _plain_head(self) -> bool:
        config = getattr(self.model, "config", None)
        return any(
            getattr(config, name, None) not in (None, 1.0)
            for name in ("final_logit_softcapping", "logit_scale")
        ) or not hasattr(self.model, "get_decoder")

    def _forward_full_logits(
        self, batch: SequenceBatch, *, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        out = self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        logits = _response_slice(batch, out.logits).float() / self.temperature
        logits = self.truncation.apply(logits, keep=batch.response_ids)
        log_probs = torch.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        logp = logp * batch.response_mask
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits) * batch.response_mask
        return logp, entropy

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, *, micro_batch_size: int = 64) -> Tensor:
        """``[B, T]`` log-probs without gradients, in micro-batches."""
        parts = [
            self(batch.rows(slice(i, i + micro_batch_size)))[0]
            for i in range(0, batch.input_ids.shape[0], micro_batch_size)
        ]
        return torch.cat(parts, dim=0)

    def named_weights(
        self, dtype: torch.dtype | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` pairs in the checkpoint's naming, for a rollout engine to load.

        Sharded parameters are gathered in buckets of ``bucket_bytes`` (a collective: every rank
        of the group must iterate in step), so no rank holds the whole model beyond its shard.
        ``dtype`` casts each shard as it is packed for the gather (the engine's dtype: half the
        bytes of the fp32 masters). Unsharded tensors are detached views of the live parameters
        unless cast: an engine that keeps them must copy. Tied weights appear once, under their
        first name.
        """
        yield from gather_full_tensors(self._weights(), bucket_bytes=bucket_bytes, dtype=dtype)

    def weight_specs(self, dtype: torch.dtype | None = None) -> list[tuple[str, Size, torch.dtype]]:
        """``(name, full shape, dtype)`` of what ``named_weights(dtype)`` yields, in its order,
        without gathering anything (a sharded parameter knows its whole shape)."""
        return [(name, tensor.shape, dtype or tensor.dtype) for name, tensor in self._weights()]

    def weight_amax(self, dtype: torch.dtype | None = None) -> dict[str, float]:
        """``max |x|`` of each tensor ``named_weights(dtype)`` yields, from the local shards and
        one all-reduce (a collective when sharded), without gathering the tensors."""
        return global_amax(self._weights(), dtype=dtype)

    def _weights(self) -> Iterator[tuple[str, Tensor]]:
        """The state dict's tensors (local shards when sharded), each once: tied weights appear
        under their first name; the same on every rank, so ranks iterate in step."""
        seen: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield name, tensor.detach()


class ValueModel(nn.Module):
    """The PPO critic: a transformer backbone plus a scalar value head per position.

    Built from the policy checkpoint (its own copy of the backbone weights) with a zero-init
    head, so the initial values are 0 everywhere.
    """

    def __init__(self, backbone: Any, hidden_size: int) -> None:
        super().__init__()
        disable_dropout(backbone)
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        gradient_checkpointing: bool = False,
    ) -> ValueModel:
        """Load the critic's backbone from a local causal-LM checkpoint."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
        critic = cls(backbone, int(backbone.config.hidden_size)).to(device)
        critic.value_head.to(torch.float32)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return critic

    def forward(self, batch: SequenceBatch) -> Tensor:
        """``[B, T]`` values ``V(s_t)`` of the state before each response token; 0 at padding."""
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        hidden = _response_slice(batch, out.last_hidden_state).float()
        values: Tensor = self.value_head(hidden).squeeze(-1)
        return values * batch.response_mask
