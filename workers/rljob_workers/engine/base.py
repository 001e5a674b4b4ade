"""The rollout-engine contract shared by every backend, and helpers the backends reuse.

Log-probability semantics (identical in every backend): ``Completion.logprobs[i]`` is the
log-probability of ``token_ids[i]`` under the distribution it was drawn from: the logits
divided by the temperature, restricted by min-p, top-k and top-p and renormalised (vLLM's
``processed_logprobs``; the rules in ``algos.sampling``); raw ``log_softmax(logits)`` for greedy
decoding. The trainer scores with the same temperature and the same restriction
(``PolicyModel(sampling=...)``), so the behaviour log-probs, the ratio, the gradient and the KL
all refer to one distribution.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import torch

FinishReason: TypeAlias = Literal["stop", "length", "abort"]
Prompts: TypeAlias = Sequence[str | Sequence[int]]


@runtime_checkable
class DecodingSource(Protocol):
    """Received weights that decompress each tensor straight into a destination tensor
    (``weightsync.DecodedWeights``): an engine that owns its parameters loads with no
    intermediate copy."""

    def names(self) -> list[str]:
        """The tensor names (checkpoint names as in ``model.state_dict()``)."""
        ...

    def decode_into(self, name: str, target: torch.Tensor) -> None:
        """Write tensor ``name``, decompressed, into ``target`` (same shape)."""
        ...

    def load_into(self, name: str, target: torch.Tensor) -> None:
        """Load tensor ``name`` into ``target``: its received storage handed over where exact
        (no copy), else ``decode_into``."""
        ...

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, decompressed."""
        ...


WeightSource: TypeAlias = (
    "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | DecodingSource | str "
    "| os.PathLike[str]"
)


@dataclass(frozen=True)
class Completion:
    """One sampled response to one prompt.

    ``token_ids`` is the response only (it ends with the EOS id when ``finish_reason`` is
    ``"stop"``); ``logprobs`` has one sampling-distribution log-probability per entry of
    ``token_ids``; ``text`` is the response decoded without special tokens; ``prompt_index``
    is the prompt's position in the ``generate`` call and ``weights_version`` the policy version
    that produced it.
    """

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weights_version: int


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout and colocated actor roles need from an inference engine."""

    @property
    def weights_version(self) -> int:
        """Policy version of the weights currently served (0 until the first ``load_weights``)."""
        ...

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
        """Sample ``n`` responses per prompt (texts or token-id lists).

        Returns ``len(prompts) * n`` completions, prompt-major: the ``n`` samples of prompt 0 first.
        ``temperature == 0`` is greedy decoding. A given ``seed`` makes the call reproducible on the
        same backend; ``None`` draws from the engine's own seeded stream.
        """
        ...

    def load_weights(self, version: int, source: WeightSource) -> None:
        """Replace the served weights with ``source`` and record ``version``.

        ``source`` is a state dict, an iterable of ``(name, tensor)`` pairs (checkpoint names as in
        ``model.state_dict()``), received weights (``DecodingSource``) or a directory holding
        ``*.safetensors``. The tensors are copied; the caller may reuse them once this returns.
        """
        ...

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (a documented no-op where unsupported)."""
        ...

    def wake(self) -> None:
        """Undo ``sleep``; the engine can generate again afterwards."""
        ...

    def close(self) -> None:
        """Release the engine's resources; it must not be used afterwards."""
        ...


def check_sampling(
    n: int, max_tokens: int, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> None:
    """Raise ``ValueError`` naming the argument when a sampling setting is out of range."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k: must be >= 0 (0: every token), got {top_k}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p: must be in [0, 1], got {min_p}")


def check_version(version: int, current: int) -> None:
    """Raise ``ValueError`` when a weight push's version is negative."""
    if version < 0:
        raise ValueError(f"version: must be >= 0, got {version} (engine serves {current})")


def request_seeds(seed: int | None, count: int, stream: random.Random) -> list[int]:
    """Derive one 63-bit sampling seed per request from ``seed`` (or from ``stream`` if None)."""
    source = stream if seed is None else random.Random(seed)
    return [source.getrandbits(63) for _ in range(count)]


def is_weight_directory(source: object) -> bool:
    """Whether a weight source is a path (to a directory of safetensors files)."""
    return isinstance(source, str | os.PathLike)


def iter_named_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs from any ``WeightSource``, detached from autograd."""
    if isinstance(source, str | os.PathLike):
        yield from _iter_safetensors(Path(source))
        return
    if isinstance(source, DecodingSource):
        yield from source.named_tensors()
        return
    pairs = source.items() if isinstance(source, Mapping) else source
    for name, tensor in pairs:
        yield name, tensor.detach()


def _iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights: no *.safetensors files in {directory}")
    for file in files:
        yield from load_file(str(file)).items()
