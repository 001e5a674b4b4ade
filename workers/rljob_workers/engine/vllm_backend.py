"""vLLM rollout backend: the only module of the project that imports vllm (lazily, in the class).

Modes (fixed per process: vLLM caches its environment once the first engine is up):

* in-process (default, ``in_process=True``): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
  executor. Weight pushes hand ``(name, tensor)`` pairs straight to the model runner
  (``reload_weights(weights_iterator=...)``; a directory is read into pairs first). On the 2-core
  dev box with the tiny model it started in ~50 s against ~280 s for the multiprocess mode (whose
  engine-core and worker processes each re-import vllm), and a push takes ~0.1 s. Side effects on
  the shared process (``torch.set_num_threads`` patched, global RNGs reseeded) are undone.
* multiprocess (``in_process=False``): the engine core runs in child processes. Tensors never
  cross the RPC (that kills the engine): a state dict is first written as safetensors to a
  temporary directory and the workers reload from that path.

Each response is decoded once when it is finished (``detokenize=False`` in the request): vLLM's
incremental detokenizer, and its decoding of every sampled log-prob's token to text, took about a
quarter of a tiny model's generate step (all per-token Python), and neither is used.

Log-probabilities are those of the sampling distribution (``logprobs_mode="processed_logprobs"``,
``SamplingParams(logprobs=0)``): ``log_softmax`` of the logits after temperature, min-p, top-k and
top-p, exactly what the transformers backend returns and the learner scores (``algos.sampling``).

vLLM wraps its sampler's log-prob gather in ``torch.compile`` even with ``enforce_eager``: the first
``generate`` of a process then spends seconds in dynamo and inductor (5-10 s on the 2-core box; a
C++ compiler must be present) for an op that ran no faster compiled (101 vs 103 ms a step, tiny
model, same tokens and log-probs). ``compile_sampler=False`` (the default) runs it eagerly: dynamo
is off while this engine works in process, ``TORCHDYNAMO_DISABLE=1`` for its engine-core processes.

Sleep mode exists only on GPU platforms: ``sleep()`` / ``wake()`` call ``LLM.sleep`` /
``LLM.wake_up`` there and are documented no-ops on CPU.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rljob_workers.engine.base import (
    Completion,
    FinishReason,
    Prompts,
    WeightSource,
    check_sampling,
    check_version,
    iter_named_tensors,
    request_seeds,
)

if TYPE_CHECKING:
    import torch


class VLLMEngine:
    """A ``RolloutEngine`` on ``vllm.LLM`` (float32, eager mode, 1 GiB CPU KV cache by default)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        in_process: bool = True,
        max_model_len: int = 256,
        dtype: str = "float32",
        kv_cache_space_gib: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 1,
        engine_args: Mapping[str, Any] | None = None,
        compile_sampler: bool = False,
    ) -> None:
        """Start a vLLM engine on the local checkpoint ``model_path``.

        ``compile_sampler`` lets vLLM ``torch.compile`` its sampler (see the module docstring).
        On CPU the KV cache is sized to the model (``kv_cache_bytes``), at most
        ``kv_cache_space_gib``; ``VLLM_CPU_KVCACHE_SPACE`` in the environment overrides both.

        ``enable_sleep_mode=None`` turns sleep mode on where the platform supports it (GPU).
        ``sleep_level`` 1 offloads weights to host memory; 2 discards them, so a ``load_weights``
        must follow ``wake``. ``engine_args`` are passed through to ``vllm.LLM``.
        """
        _prepare_environment(in_process=in_process, compile_sampler=compile_sampler)
        from vllm import LLM
        from vllm.platforms import current_platform

        _check_process_mode(in_process)
        sleep_available = bool(current_platform.is_sleep_mode_available())
        self._sleep_enabled = sleep_available if enable_sleep_mode is None else enable_sleep_mode
        self._sleep_level = sleep_level
        self._asleep = False
        self._in_process = in_process
        self._compile_sampler = compile_sampler
        self._stream = random.Random(seed)
        self._version = 0
        args: dict[str, Any] = {
            "model": str(model_path),
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": True,
            "max_model_len": max_model_len,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self._sleep_enabled,
        }
        if in_process:
            args["distributed_executor_backend"] = "uni"
        if current_platform.is_cpu():
            # a prefill split over steps rolls its seeded generator back, which a CPU torch
            # Generator cannot do (vLLM: "CPU Generator does not use offset"); batches of long
            # prompts (chat templates, word problems) were split
            args["enable_chunked_prefill"] = False
        if not current_platform.is_cpu():
            args["gpu_memory_utilization"] = gpu_memory_utilization
        elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # that legacy setting wins in vLLM
            args["kv_cache_memory_bytes"] = kv_cache_bytes(
                model_path, max_model_len=max_model_len, dtype=dtype, cap_gib=kv_cache_space_gib
            )
        args.update(engine_args or {})
        with _preserve_process_state(enabled=in_process), self._eager():
            self._llm = LLM(**args)
        self.tokenizer = self._llm.get_tokenizer()
        self._tied = _tied_weight_aliases(self._llm.llm_engine.model_config.hf_config)

    @property
    def weights_version(self) -> int:
        """Policy version of the weights currently served."""
        return self._version

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in this process."""
        return self._in_process

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
        """Sample ``n`` responses per prompt; see ``RolloutEngine.generate``.

        Each prompt is one vLLM request with its own seed derived from ``seed``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_sampling(n, max_tokens, temperature, top_p, top_k, min_p)
        prompt_ids = self.encode(prompts)
        params = [
            SamplingParams(
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=request_seed,
                logprobs=0,
                skip_special_tokens=True,
                detokenize=False,  # decoded once at the end (_completion), not token by token
            )
            for request_seed in request_seeds(seed, len(prompt_ids), self._stream)
        ]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        with self._eager():
            outputs = self._llm.generate(requests, params, use_tqdm=False)
        return [
            self._completion(index, prompt_ids[index], sample)
            for index, output in enumerate(outputs)
            for sample in sorted(output.outputs, key=lambda sample: sample.index)
        ]

    def encode(self, prompts: Prompts) -> list[list[int]]:
        """Token ids of each prompt (texts are tokenized; id lists are passed through)."""
        encoded = [
            list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
            for prompt in prompts
        ]
        for index, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompts[{index}]: empty prompt")
        return encoded

    def load_weights(self, version: int, source: WeightSource) -> None:
        """Reload the served weights in place from ``source`` and clear the prefix cache.

        Tied weights: vLLM's CPU linear layers keep a packed copy of their weight, and a tied
        ``lm_head`` is repacked only when its own name is part of the reload. A source without
        it (``save_pretrained`` drops tied entries) would leave stale logits, so the alias is
        added from its canonical tensor (``model.embed_tokens.weight``).
        """
        check_version(version, self._version)
        if (
            isinstance(source, str | os.PathLike)
            and not self._in_process
            and _has_names(Path(source), self._tied)
        ):
            self._reload(weights_path=str(source))
        elif self._in_process:
            pairs = _with_tied_aliases(iter_named_tensors(source), self._tied)
            self._reload(weights_iterator=pairs)
        else:
            pairs = _with_tied_aliases(iter_named_tensors(source), self._tied)
            with _safetensors_directory(pairs) as staged:
                self._reload(weights_path=staged)
        self._version = version

    def sleep(self) -> None:
        """Release accelerator memory (``LLM.sleep``); a no-op on CPU, where vLLM has no sleep."""
        if self._sleep_enabled and not self._asleep:
            self._llm.sleep(level=self._sleep_level)
            self._asleep = True

    def wake(self) -> None:
        """Undo ``sleep`` (``LLM.wake_up``); a no-op when sleep mode is off (CPU)."""
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine core (and its processes, in multiprocess mode) down."""
        self._llm.llm_engine.engine_core.shutdown()

    def _eager(self) -> contextlib.AbstractContextManager[Any]:
        """Dynamo off while the in-process engine works, unless ``compile_sampler``."""
        if self._compile_sampler or not self._in_process:
            return contextlib.nullcontext()
        import torch._dynamo

        patch: contextlib.AbstractContextManager[Any] = torch._dynamo.config.patch(disable=True)
        return patch

    def _reload(self, **kwargs: Any) -> None:
        self._llm.collective_rpc("reload_weights", kwargs=kwargs)
        self._llm.reset_prefix_cache()

    def _completion(self, index: int, prompt_ids: list[int], sample: Any) -> Completion:
        tokens = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no sampled-token logprobs (logprobs=0 was requested)")
        logprobs = [
            float(step[token].logprob) for token, step in zip(tokens, sample.logprobs, strict=True)
        ]
        finish: FinishReason = sample.finish_reason or "length"
        return Completion(
            prompt_index=index,
            prompt_ids=list(prompt_ids),
            token_ids=tokens,
            logprobs=logprobs,
            text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
            finish_reason=finish,
            weights_version=self._version,
        )


def _prepare_environment(*, in_process: bool, compile_sampler: bool = False) -> None:
    """Set the vLLM environment before vllm is imported (explicit settings win)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process and not compile_sampler:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # read by the engine-core processes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


KV_CACHE_SEQUENCES = 256
"""Sequences of ``max_model_len`` tokens a CPU KV cache holds (vLLM's default ``max_num_seqs``)."""


def kv_cache_bytes(
    model_path: str | Path, *, max_model_len: int, dtype: str, cap_gib: float
) -> int:
    """A CPU KV cache that holds ``KV_CACHE_SEQUENCES`` full-length sequences, at most ``cap_gib``.

    vLLM's CPU default is a fixed size (1 GiB here), allocated and touched at start-up whatever
    the model: a tiny model needs ~30 MiB of it, so its engine used ~1 GiB more memory than the
    weights explain. Models whose full cache would exceed the cap get the cap, as before.
    """
    import json

    raw = json.loads((Path(model_path) / "config.json").read_text())
    text = raw.get("text_config", raw)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    element = 4 if dtype == "float32" else 2
    per_token = 2 * int(text["num_hidden_layers"]) * kv_heads * head_dim * element
    block_slack = 128  # each sequence may end in a partly filled block
    need = per_token * KV_CACHE_SEQUENCES * (max_model_len + block_slack)
    return int(min(need, cap_gib * 2**30))


def _check_process_mode(in_process: bool) -> None:
    import vllm.envs as envs

    if bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) == in_process:
        wanted = "in-process" if in_process else "multiprocess"
        raise RuntimeError(
            f"in_process: an engine of the other mode already ran in this process and vLLM "
            f"cached its environment; start {wanted} engines in a separate process"
        )


@contextlib.contextmanager
def _preserve_process_state(*, enabled: bool) -> Iterator[None]:
    """Undo the process-wide side effects of starting an in-process engine.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op and seeds the global
    ``random`` / numpy / torch generators; a colocated trainer shares this process, so restore them.
    """
    if not enabled:
        yield
        return
    import numpy as np
    import torch

    set_num_threads = torch.set_num_threads
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _tied_weight_aliases(hf_config: Any) -> dict[str, str]:
    """``{alias: canonical}`` checkpoint names of weights tied in this model (may be empty)."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return {}
    import transformers

    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    for architecture in getattr(hf_config, "architectures", None) or []:
        declared = getattr(getattr(transformers, architecture, None), "_tied_weights_keys", None)
        if isinstance(declared, dict):
            aliases = {str(alias): str(canonical) for alias, canonical in declared.items()}
    return aliases


def _with_tied_aliases(
    pairs: Iterable[tuple[str, torch.Tensor]], aliases: Mapping[str, str]
) -> list[tuple[str, torch.Tensor]]:
    """The pairs plus an ``(alias, canonical tensor)`` entry for each alias they lack."""
    weights = list(pairs)
    by_name = dict(weights)
    for alias, canonical in aliases.items():
        if alias not in by_name and canonical in by_name:
            weights.append((alias, by_name[canonical]))
    return weights


def _has_names(directory: Path, names: Iterable[str]) -> bool:
    """Whether the safetensors files in ``directory`` hold every one of ``names``."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            found.update(handle.keys())
    return set(names) <= found


@contextlib.contextmanager
def _safetensors_directory(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """Write named tensors to a temporary safetensors directory (tensors copied, so tied
    weights that share storage can be saved)."""
    from safetensors.torch import save_file

    tensors = {name: tensor.cpu().contiguous().clone() for name, tensor in pairs}
    with tempfile.TemporaryDirectory(prefix="rljob-weights-") as directory:
        save_file(tensors, str(Path(directory) / "model.safetensors"))
        yield directory
