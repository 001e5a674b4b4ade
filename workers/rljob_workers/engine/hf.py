"""Hugging Face transformers rollout backend: the reference and CPU fallback.

Sampling runs a plain KV-cached decode loop over a left-padded batch. The returned
log-probabilities are those of the distribution the tokens were drawn from: the logits divided
by ``temperature``, restricted by ``min_p``, ``top_k`` and ``top_p`` (``algos.sampling``, vLLM's
rules) and renormalised, as in every backend (see ``base``); greedy decoding (``temperature == 0``)
returns the raw model log-probabilities.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rljob_workers.algos.sampling import Truncation
from rljob_workers.engine.base import (
    Completion,
    DecodingSource,
    FinishReason,
    Prompts,
    WeightSource,
    check_sampling,
    check_version,
    iter_named_tensors,
    request_seeds,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class HFEngine:
    """A ``RolloutEngine`` on a transformers causal LM (float32 on CPU by default)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        max_batch_tokens: int = 16384,
    ) -> None:
        """Load model and tokenizer from the local directory ``model_path`` (nothing is fetched).

        A ``generate`` decodes its rows in chunks of ``max_batch_size`` rows, or more when they
        are short: as many as fit ``max_batch_tokens`` (prompt + response tokens per row). One
        chunk of 128 toy rows decoded in 31 ms where two of 64 took 41 ms.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(model_path), local_files_only=True
        )
        self.device = torch.device(device)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=dtype, local_files_only=True
        )
        torch.nn.Module.to(self.model, self.device)
        self.model.train(False)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self._stream = random.Random(seed)
        self._version = 0
        self._stop_ids = _stop_token_ids(self.model, self.tokenizer)
        self._pad_id = _pad_token_id(self.tokenizer, self._stop_ids)

    @property
    def weights_version(self) -> int:
        """Policy version of the weights currently served."""
        return self._version

    def generate(
        self,
        prompts: Prompts,
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` responses per prompt; see ``RolloutEngine.generate``."""
        check_sampling(n, max_tokens, temperature, top_p, top_k, min_p)
        rule = _Rule(temperature, Truncation(top_k, top_p, min_p))
        prompt_ids = self.encode(prompts)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(request_seeds(seed, 1, self._stream)[0])
        rows = [(index, ids) for index, ids in enumerate(prompt_ids) for _ in range(n)]
        completions: list[Completion] = []
        row_tokens = max((len(ids) for ids in prompt_ids), default=1) + max_tokens
        chunk_rows = max(self.max_batch_size, self.max_batch_tokens // row_tokens)
        for start in range(0, len(rows), chunk_rows):
            chunk = rows[start : start + chunk_rows]
            completions += self._generate_chunk(chunk, max_tokens, rule, generator)
        return completions

    def encode(self, prompts: Prompts) -> list[list[int]]:
        """Token ids of each prompt (texts are tokenized; id lists are passed through)."""
        encoded = [
            list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
            for prompt in prompts
        ]
        for index, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompts[{index}]: empty prompt")
        return encoded

    @torch.inference_mode()
    def compute_logprobs(
        self,
        prompt_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
    ) -> list[float]:
        """Log-probabilities of ``token_ids`` following ``prompt_ids`` (teacher forcing) under
        the sampling distribution of these settings (raw at the defaults)."""
        ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        chosen = torch.tensor(list(token_ids), device=self.device)
        logprobs = _Rule(temperature, Truncation(top_k, top_p, min_p)).logprobs(logits)
        return [float(value) for value in logprobs.gather(-1, chosen[:, None])[:, 0]]

    @torch.no_grad()
    def load_weights(self, version: int, source: WeightSource) -> None:
        """Copy the named tensors of ``source`` into the model; unknown names raise ``KeyError``.

        Tied weights follow vLLM: an alias (``lm_head.weight`` when the embeddings are tied) is
        ignored, the canonical name (``model.embed_tokens.weight``) is what gets loaded.
        """
        check_version(version, self._version)
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        params.update(self.model.named_buffers())
        aliases = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        if isinstance(source, DecodingSource):  # handed over, or decompressed straight in
            for name in source.names():
                if _is_loaded(name, params, aliases):
                    source.load_into(name, params[name])
        else:
            for name, tensor in iter_named_tensors(source):
                if _is_loaded(name, params, aliases):
                    params[name].copy_(tensor)
        self._version = version

    def sleep(self) -> None:
        """No-op: the transformers backend keeps its weights where they are."""

    def wake(self) -> None:
        """No-op counterpart of ``sleep``."""

    def close(self) -> None:
        """Drop the model reference (the engine must not be used afterwards)."""
        del self.model

    @torch.inference_mode()
    def _generate_chunk(
        self,
        rows: list[tuple[int, list[int]]],
        max_tokens: int,
        rule: _Rule,
        generator: torch.Generator,
    ) -> list[Completion]:
        from transformers import DynamicCache

        input_ids, attention = self._left_pad([ids for _, ids in rows])
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            past_key_values=cache, use_cache=True,
        )  # fmt: skip
        batch = len(rows)
        sampled = torch.empty((batch, 0), dtype=torch.long, device=self.device)
        logprobs = torch.empty((batch, 0), dtype=torch.float32, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stop_ids = torch.tensor(sorted(self._stop_ids), device=self.device)
        for _ in range(max_tokens):
            logits = out.logits[:, -1, :].float()
            token, token_logprob = rule.sample(logits, generator)
            sampled = torch.cat([sampled, token[:, None]], dim=1)
            logprobs = torch.cat([logprobs, token_logprob], dim=1)
            done |= torch.isin(token, stop_ids)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                past_key_values=out.past_key_values, use_cache=True,
            )  # fmt: skip
        return [
            self._completion(index, ids, sampled[row].tolist(), logprobs[row].tolist())
            for row, (index, ids) in enumerate(rows)
        ]

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    def _completion(
        self, index: int, prompt_ids: list[int], tokens: list[int], logprobs: list[float]
    ) -> Completion:
        finish: FinishReason = "length"
        for position, token in enumerate(tokens):
            if token in self._stop_ids:
                tokens, logprobs, finish = tokens[: position + 1], logprobs[: position + 1], "stop"
                break
        text = str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return Completion(
            prompt_index=index,
            prompt_ids=list(prompt_ids),
            token_ids=tokens,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            weights_version=self._version,
        )


@dataclass(frozen=True)
class _Rule:
    """The sampling settings of one ``generate`` call."""

    temperature: float
    truncation: Truncation

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[batch, vocab]`` log-probs tokens are drawn from: ``log_softmax`` of the tempered,
        restricted logits (``algos.sampling``); the raw model log-probs at T = 0 (greedy)."""
        if self.temperature == 0:
            return torch.log_softmax(logits, dim=-1)
        return torch.log_softmax(self.truncation.apply(logits / self.temperature), dim=-1)

    def sample(
        self, logits: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``logits`` [batch, vocab] (greedy at T = 0) and its
        log-prob ``[batch, 1]``."""
        logprobs = self.logprobs(logits)
        if self.temperature == 0:
            token = logits.argmax(dim=-1)
        else:
            token = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        return token, logprobs.gather(-1, token[:, None])


def _stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    configured = model.generation_config.eos_token_id if model.generation_config else None
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return set()
    return set(configured) if isinstance(configured, list) else {int(configured)}


def _pad_token_id(tokenizer: PreTrainedTokenizerBase, stop_ids: set[int]) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return min(stop_ids) if stop_ids else 0


def _is_loaded(name: str, params: dict[str, torch.Tensor], aliases: set[str]) -> bool:
    """Whether ``name`` is a parameter to load; a tied alias is skipped, anything else raises."""
    if name in params:
        return True
    if name not in aliases:
        raise KeyError(f"weights: {name!r} is not a parameter of the model")
    return False
