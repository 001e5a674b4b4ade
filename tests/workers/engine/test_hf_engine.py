"""Transformers rollout backend and the engine factory.

Aspects under test:
- the backend satisfies the RolloutEngine protocol; make_engine rejects unknown kinds
- output layout: prompt-major, n per prompt, prompt ids with <s>, text decoded from tokens
- greedy decoding is deterministic; seeded sampling is reproducible, unseeded calls differ
- logprobs are those of the sampling distribution (tempered, nucleus-renormalised) and equal
  teacher-forced scoring of it
- batching with left padding gives the same greedy tokens as one prompt at a time; short rows
  are decoded in chunks larger than max_batch_size (up to max_batch_tokens), long ones not
- EOS ends a completion with finish_reason "stop" and is included in token_ids
- load_weights from a state dict or a safetensors directory changes outputs and the version;
  unknown names and bad sampling arguments fail with the name in the message
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rljob_workers.engine import RolloutEngine, make_engine
from rljob_workers.engine.hf import HFEngine

PROMPTS = ["copy:7=", "next:3=", "3+4="]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    built = make_engine("hf", tiny_model_dir, seed=0)
    assert isinstance(built, HFEngine)
    return built


def _perturbed(engine: HFEngine, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A trainer-like state dict: every parameter moved, tied entries kept tied."""
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        moved = {
            name: param + scale * torch.randn(param.shape, generator=generator)
            for name, param in engine.model.named_parameters()
        }
    moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
    return moved


def test_hf_engine_protocol_satisfied(engine):
    assert isinstance(engine, RolloutEngine)


def test_make_engine_unknown_kind_raises(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown kind 'sglang'"):
        make_engine("sglang", tiny_model_dir)


def test_generate_n_per_prompt_prompt_major_layout(engine):
    completions = engine.generate(PROMPTS, n=3, max_tokens=5, seed=1)
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert completions[3].prompt_ids == engine.encode(["next:3="])[0]
    assert completions[3].prompt_ids[0] == engine.tokenizer.bos_token_id
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) <= 5
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert all(lp <= 0 for lp in c.logprobs)


def test_generate_token_id_prompts_equal_text_prompts(engine):
    by_text = engine.generate(PROMPTS, temperature=0, max_tokens=4)
    by_ids = engine.generate(engine.encode(PROMPTS), temperature=0, max_tokens=4)
    assert [c.token_ids for c in by_text] == [c.token_ids for c in by_ids]


def test_generate_same_seed_reproducible_unseeded_differs(engine):
    first = engine.generate(PROMPTS, n=4, max_tokens=6, seed=7)
    again = engine.generate(PROMPTS, n=4, max_tokens=6, seed=7)
    other = engine.generate(PROMPTS, n=4, max_tokens=6)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_generate_logprobs_are_the_sampling_distribution_and_equal_teacher_forcing(engine):
    hot = engine.generate(PROMPTS, n=2, max_tokens=6, temperature=2.0, top_p=0.8, seed=3)
    for c in hot:
        scored = engine.compute_logprobs(c.prompt_ids, c.token_ids, temperature=2.0, top_p=0.8)
        assert scored == pytest.approx(c.logprobs, abs=1e-5)


def test_generate_logprobs_at_temperature_are_tempered_softmax(engine):
    # by hand: log_softmax(logits / T) of the sampled token (top_p 1: no nucleus)
    completion = engine.generate(["copy:7="], max_tokens=1, temperature=0.5, seed=1)[0]
    ids = torch.tensor([completion.prompt_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, -1].float()
    expected = torch.log_softmax(logits / 0.5, dim=-1)[completion.token_ids[0]]
    assert completion.logprobs[0] == pytest.approx(float(expected), abs=1e-5)


def test_generate_batched_left_padding_equals_single(engine):
    prompts = ["1+2=", "copy:5=", "next:9=", "ab"]
    batched = engine.generate(prompts, temperature=0, max_tokens=6)
    single = [engine.generate([p], temperature=0, max_tokens=6)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]
    for b, s in zip(batched, single, strict=True):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)


class _ChunkCounting(HFEngine):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.chunks: list[int] = []

    def _generate_chunk(self, chunk, *args):  # type: ignore[no-untyped-def]
        self.chunks.append(len(chunk))
        return super()._generate_chunk(chunk, *args)


def test_generate_short_rows_fill_token_budget_long_rows_keep_max_batch_size(tiny_model_dir):
    engine = _ChunkCounting(tiny_model_dir, seed=0, max_batch_size=4, max_batch_tokens=200)
    prompts = ["copy:7=", "next:3=", "3+4="]  # 8 tokens at most with <s>
    assert len(engine.generate(prompts, n=4, max_tokens=2)) == 12
    assert engine.chunks == [12]  # 12 rows x 10 tokens fit 200
    engine.chunks.clear()
    assert len(engine.generate(prompts, n=4, max_tokens=60)) == 12
    assert engine.chunks == [4, 4, 4]  # 200 // 68 = 2 rows: the 4-row floor applies


def test_generate_eos_sampled_finish_reason_stop(engine):
    completions = engine.generate(PROMPTS, n=8, max_tokens=24, seed=0)
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped, "a random model at temperature 1 emits </s> within 24 tokens"
    eos = engine.tokenizer.eos_token_id
    assert all(c.token_ids[-1] == eos and eos not in c.token_ids[:-1] for c in stopped)
    assert all(len(c.token_ids) == 24 for c in completions if c.finish_reason == "length")


def test_generate_bad_sampling_argument_named(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, top_p=0.0)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate(["a", []])


def test_load_weights_state_dict_changes_outputs_and_version(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    before = engine.generate(PROMPTS, temperature=0, max_tokens=8)
    engine.load_weights(1, _perturbed(engine))
    after = engine.generate(PROMPTS, temperature=0, max_tokens=8)
    assert engine.weights_version == 1 and all(c.weights_version == 1 for c in after)
    assert [c.token_ids for c in before] != [c.token_ids for c in after]


def test_load_weights_directory_equals_state_dict(tiny_model_dir, tmp_path):
    from_dict, from_dir = HFEngine(tiny_model_dir), HFEngine(tiny_model_dir)
    weights = _perturbed(from_dict)
    from_dict.load_weights(2, weights)
    save_file({k: v.clone() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    from_dir.load_weights(2, tmp_path)
    for name, tensor in from_dict.model.state_dict().items():
        assert torch.equal(tensor, from_dir.model.state_dict()[name])


def test_load_weights_tied_alias_ignored_canonical_loaded(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    embed = engine.model.get_input_embeddings().weight
    engine.load_weights(1, {"lm_head.weight": torch.zeros_like(embed)})
    assert embed.abs().sum() > 0
    engine.load_weights(2, {"model.embed_tokens.weight": torch.ones_like(embed)})
    assert torch.equal(engine.model.get_output_embeddings().weight, torch.ones_like(embed))


def test_load_weights_unknown_name_raises(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    with pytest.raises(KeyError, match=r"model\.nonexistent"):
        engine.load_weights(1, {"model.nonexistent": torch.zeros(1)})
    assert engine.weights_version == 0


def test_sleep_wake_noop_keeps_generating(engine):
    engine.sleep()
    engine.wake()
    assert len(engine.generate(["1+1="], max_tokens=2, seed=0)) == 1


@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
def test_load_weights_received_payload_equals_its_decoded_pairs(tiny_model_dir, compression):
    from rljob_workers.weightsync import decode_weights, encode_weights

    direct, from_pairs = HFEngine(tiny_model_dir), HFEngine(tiny_model_dir)
    received = decode_weights(encode_weights(3, _perturbed(direct), compression))

    direct.load_weights(3, received)  # decompressed straight into each parameter
    from_pairs.load_weights(3, received.named_tensors())

    assert direct.weights_version == 3
    for name, tensor in from_pairs.model.state_dict().items():
        assert torch.equal(tensor, direct.model.state_dict()[name]), name


def test_load_weights_received_uncompressed_payload_is_not_copied(tiny_model_dir):
    from rljob_workers.weightsync import decode_weights, encode_weights

    engine = HFEngine(tiny_model_dir)
    received = decode_weights(encode_weights(2, _perturbed(engine), "none"))

    engine.load_weights(2, received)

    params = dict(engine.model.named_parameters())
    name = "model.embed_tokens.weight"
    assert params[name].data_ptr() == received.wire[name].data_ptr()
    assert torch.equal(engine.model.lm_head.weight, received.wire[name])  # still tied


def test_load_weights_received_payload_unknown_name_raises(tiny_model_dir):
    from rljob_workers.weightsync import decode_weights, encode_weights

    engine = HFEngine(tiny_model_dir)
    received = decode_weights(encode_weights(1, {"model.nonexistent": torch.zeros(1)}, "fp8"))
    with pytest.raises(KeyError, match=r"model\.nonexistent"):
        engine.load_weights(1, received)
    assert engine.weights_version == 0
