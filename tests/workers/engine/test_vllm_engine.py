"""vLLM rollout backend (in-process mode) against the transformers reference, on the tiny model.

Aspects under test:
- greedy token ids are equal and their log-probs within 1e-4 of the transformers backend
- sampled tokens' log-probs are those of the sampling distribution in both backends (vLLM's
  equal transformers' teacher forcing of it, also at temperature != 1 with top-p)
- seeded sampling is reproducible; EOS ends a completion with finish_reason "stop" in both
- a live weight push (state dict; a save_pretrained directory without the tied lm_head; a state
  dict of canonical names only) changes vLLM's outputs, and vLLM and transformers still agree
  afterwards (a stale packed lm_head would break this); the version is recorded on completions
- sleep / wake are no-ops on CPU and the engine keeps generating
"""

from __future__ import annotations

import time

import pytest
import torch

from rljob_workers.engine import RolloutEngine, make_engine
from rljob_workers.engine.hf import HFEngine
from rljob_workers.engine.vllm_backend import kv_cache_bytes

pytestmark = pytest.mark.slow

PROMPTS = ["copy:7=", "next:3=", "3+4=", "9+9=", "copy:0=", "abc"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    started = time.perf_counter()
    engine = make_engine("vllm", tiny_model_dir, seed=0, max_model_len=128)
    print(f"\nvLLM in-process engine started in {time.perf_counter() - started:.1f}s")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir) -> HFEngine:
    return HFEngine(tiny_model_dir, seed=0)


def _perturbed(hf_engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    """A trainer-like state dict: every parameter moved, tied entries kept tied."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moved = {
            name: param + 0.3 * torch.randn(param.shape, generator=generator)
            for name, param in hf_engine.model.named_parameters()
        }
    moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
    return moved


def _assert_greedy_agree(vllm_engine, hf_engine) -> list[list[int]]:
    fast = vllm_engine.generate(PROMPTS, temperature=0, max_tokens=8)
    reference = hf_engine.generate(PROMPTS, temperature=0, max_tokens=8)
    for ours, theirs in zip(fast, reference, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=TOLERANCE)
        assert ours.text == theirs.text and ours.finish_reason == theirs.finish_reason
    return [c.token_ids for c in fast]


def _assert_sampled_logprobs_agree(vllm_engine, hf_engine, **sampling) -> None:
    for c in vllm_engine.generate(PROMPTS, n=3, max_tokens=8, seed=11, **sampling):
        scored = hf_engine.compute_logprobs(c.prompt_ids, c.token_ids, **sampling)
        assert c.logprobs == pytest.approx(scored, abs=TOLERANCE)


def test_vllm_engine_protocol_satisfied(vllm_engine):
    assert isinstance(vllm_engine, RolloutEngine)
    assert vllm_engine.in_process and vllm_engine.weights_version == 0


def test_vllm_generate_default_compiles_nothing(vllm_engine):
    """vLLM's sampler runs eagerly: no dynamo frame is compiled on a (re)started generate."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # forget any compiled code, so a compiling sampler would compile again
    before = counters["frames"]["total"]
    vllm_engine.generate(PROMPTS, n=2, max_tokens=4, seed=3)
    assert counters["frames"]["total"] == before


def test_vllm_cpu_kv_cache_sized_to_the_model_not_a_fixed_gib(vllm_engine, tiny_model_dir):
    cache = vllm_engine._llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == kv_cache_bytes(
        tiny_model_dir, max_model_len=128, dtype="float32", cap_gib=1
    )
    assert cache.kv_cache_memory_bytes < 64 * 2**20  # vLLM's CPU default here: 1 GiB
    assert kv_cache_bytes(tiny_model_dir, max_model_len=10**6, dtype="float32", cap_gib=1) == 2**30


def test_vllm_greedy_equals_hf_ids_and_logprobs(vllm_engine, hf_engine):
    _assert_greedy_agree(vllm_engine, hf_engine)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 1.7, "top_p": 0.8},
        {"temperature": 1.5, "top_k": 4},
        {"temperature": 1.5, "min_p": 0.7},
        {"temperature": 1.3, "top_p": 0.9, "top_k": 6, "min_p": 0.5},
    ],
)
def test_vllm_sampled_logprobs_equal_hf_sampling_scores(vllm_engine, hf_engine, sampling):
    _assert_sampled_logprobs_agree(vllm_engine, hf_engine, **sampling)


def test_vllm_seeded_sampling_reproducible(vllm_engine):
    first = vllm_engine.generate(PROMPTS, n=4, max_tokens=6, seed=5)
    again = vllm_engine.generate(PROMPTS, n=4, max_tokens=6, seed=5)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.prompt_index for c in first] == [i for i in range(len(PROMPTS)) for _ in range(4)]
    assert len({tuple(c.token_ids) for c in first[:4]}) > 1, "n samples of a prompt differ"


def test_vllm_eos_finish_reason_stop_like_hf(vllm_engine, hf_engine):
    completions = vllm_engine.generate(PROMPTS, n=8, max_tokens=30, seed=2)
    eos = hf_engine.tokenizer.eos_token_id
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    assert all(c.token_ids[-1] == eos and "</s>" not in c.text for c in stopped)
    assert all(len(c.token_ids) == 30 for c in completions if c.finish_reason == "length")


def test_vllm_sleep_wake_noop_on_cpu_keeps_generating(vllm_engine):
    vllm_engine.sleep()
    vllm_engine.wake()
    assert len(vllm_engine.generate(["1+1="], max_tokens=2, seed=0)) == 1


def test_vllm_weight_push_changes_outputs_and_still_equals_hf(vllm_engine, hf_engine, tmp_path):
    before = _assert_greedy_agree(vllm_engine, hf_engine)
    original = {name: p.detach().clone() for name, p in hf_engine.model.named_parameters()}
    try:
        pushed = _perturbed(hf_engine, seed=1)
        vllm_engine.load_weights(1, pushed)
        hf_engine.load_weights(1, pushed)
        after_push = _assert_greedy_agree(vllm_engine, hf_engine)
        assert after_push != before
        _assert_sampled_logprobs_agree(vllm_engine, hf_engine, temperature=1.0)
        assert vllm_engine.weights_version == 1
        assert vllm_engine.generate(["1+1="], max_tokens=1)[0].weights_version == 1

        hf_engine.load_weights(2, _perturbed(hf_engine, seed=2))
        hf_engine.model.save_pretrained(str(tmp_path))  # drops the tied lm_head.weight
        vllm_engine.load_weights(2, tmp_path)
        assert _assert_greedy_agree(vllm_engine, hf_engine) != after_push
    finally:
        vllm_engine.load_weights(0, original)
        hf_engine.load_weights(0, original)
    assert _assert_greedy_agree(vllm_engine, hf_engine) == before
