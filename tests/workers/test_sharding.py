"""The sharded trainer on the tiny Qwen2 (gloo, CPU).

Aspects under test:
- precision: fp32 master weights, the forward in bf16 (one step at lr 1e-6 moves the weights);
  float16 refused;
- micro-batches: packed under the token budget; the same loss and gradients as one minibatch;
- fsdp vs ddp on 2 ranks: the same losses and parameters; per-rank state 1/2 (and 1/4 on 4
  ranks) of ddp's;
- sharded checkpoints: resume on 1 and 4 ranks from 2; a rank killed while saving; a
  first-release checkpoint resumes into fsdp;
- the exported Hugging Face model loads with transformers and scores like the policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from rljob_workers.checkpoint import capture_rng_state, resume_point
from rljob_workers.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    TrainerConfig,
    WorkerConfig,
)
from rljob_workers.export import export_checkpoint, export_policy
from rljob_workers.learner import Experience, build_learner
from rljob_workers.policy import build_sequence_batch, split_micro_batches
from rljob_workers.sharding import local_state_bytes
from rljob_workers.tinymodel import build_tiny_model
from tests.workers.gloo_ranks import run_ranks

RANKS_SCRIPT = str(Path(__file__).with_name("sharded_ranks.py"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, num_layers=4)


def _config(
    model,
    out: Path,
    *,
    dtype="float32",
    lr=1e-3,
    aggregation="token-mean",
    micro_batch_tokens=None,
    sharding="ddp",
    checkpointing=False,
    ppo=False,
) -> WorkerConfig:
    algorithm = (
        {"name": "ppo", "advantage_estimator": "gae", "kl_coef": 0.1}
        if ppo
        else {"name": "grpo", "advantage_estimator": "grpo"}
    )
    return WorkerConfig(
        job_name="sharding-test",
        topology="disaggregated",
        algorithm=AlgorithmConfig(
            **algorithm,
            learning_rate=lr,
            group_size=2,
            batch_size=4,
            mini_batch_size=4,
            max_grad_norm=1e6,
            loss_aggregation=aggregation,
        ),
        model=ModelConfig(path=str(model), dtype=dtype),
        task=TaskConfig(builtin="copy", num_prompts=16),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=6)),
        trainer=TrainerConfig(
            sharding=sharding,
            micro_batch_tokens=micro_batch_tokens,
            gradient_checkpointing=checkpointing,
        ),
        checkpoint=CheckpointConfig(dir=str(out / "ckpt"), every_steps=0),
        output_dir=str(out),
    )


def _experience(seed: int, groups: int = 4) -> Experience:
    from tests.workers.sharded_ranks import experience

    del groups
    return experience(seed, 0, 1)


def _grads(learner) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in learner.policy.parameters()])


# ---------------------------------------------------------------------------- precision


def test_bf16_compute_one_step_at_lr_1e6_moves_99_percent_of_weights(tiny_model, tmp_path):
    learner = build_learner(
        _config(tiny_model, tmp_path, dtype="bfloat16", lr=1e-6), pad_id=0, rank=0, world_size=1
    )
    before = [p.detach().clone() for p in learner.policy.parameters()]

    learner.update(_experience(0), seed=0)

    moved = total = 0
    for param, old in zip(learner.policy.parameters(), before, strict=True):
        assert param.dtype == torch.float32  # the master copy
        touched = param.grad != 0
        moved += int((param.detach() != old)[touched].sum())
        total += int(touched.sum())
    assert total > 0
    assert moved / total >= 0.99  # bf16 parameters stepped directly: about 2%


def test_float16_compute_refused_naming_the_field(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"spec\.model\.dtype: float16 .* use bfloat16"):
        build_learner(
            _config(tiny_model, tmp_path, dtype="float16"), pad_id=0, rank=0, world_size=1
        )


# ------------------------------------------------------------------------- micro-batches


def test_split_micro_batches_packs_under_the_budget_and_covers_every_row_once():
    prompts = [[1] * p for p in (3, 9, 2, 5, 7, 1)]
    responses = [[2] * r for r in (4, 1, 6, 2, 3, 5)]
    batch = build_sequence_batch(prompts, responses, pad_id=0)

    parts = split_micro_batches(batch, token_budget=24)

    rows = sorted(int(r) for part in parts for r in part)
    assert rows == list(range(6))
    for part in parts:
        micro = batch.rows(part).compact()
        if len(part) > 1:
            assert micro.input_ids.numel() <= 24
    assert len(parts) > 1
    assert split_micro_batches(batch, None)[0].tolist() == list(range(6))


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_give_the_minibatch_loss_and_gradients(tiny_model, tmp_path, aggregation):
    results = []
    for budget in (None, 12):
        torch.manual_seed(0)
        learner = build_learner(
            _config(tiny_model, tmp_path, aggregation=aggregation, micro_batch_tokens=budget),
            pad_id=0,
            rank=0,
            world_size=1,
        )
        metrics = learner.update(_experience(3), seed=0)
        results.append((metrics, _grads(learner)))
    (whole, whole_grads), (split, split_grads) = results
    # float32 sums in another order: within 1e-5 relative
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert split["policy_loss"] == pytest.approx(whole["policy_loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(split_grads, whole_grads, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------ fsdp vs ddp


def _write_config(tmp_path: Path, model: Path, **kwargs) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(_config(model, tmp_path, **kwargs).dump())
    return tmp_path


@pytest.fixture(scope="module")
def two_rank_layouts(tiny_model, tmp_path_factory):
    out = {}
    for sharding in ("ddp", "fsdp"):
        folder = _write_config(tmp_path_factory.mktemp(sharding), tiny_model)
        out[sharding] = run_ranks(
            RANKS_SCRIPT, folder, sharding, world=2, args=("compare", sharding)
        )
    return out


def test_fsdp_and_ddp_train_the_same_on_two_ranks(two_rank_layouts):
    ddp, fsdp = two_rank_layouts["ddp"], two_rank_layouts["fsdp"]
    # the same global losses step by step, and the same parameters after 3 AdamW steps
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(fsdp[0]["params"], ddp[0]["params"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fsdp[1]["params"], fsdp[0]["params"])
    # gathered in buckets of 1 KiB (most tensors alone exceed it): the same weights
    assert torch.equal(fsdp[0]["params_small_buckets"], fsdp[0]["params"])


@pytest.mark.parametrize(
    "variant",
    [{"checkpointing": True}, {"ppo": True, "micro_batch_tokens": 16}],
    ids=["gradient-checkpointing", "ppo-critic-reference-micro-batches"],
)
def test_fsdp_matches_ddp_with_checkpointing_and_with_critic_and_reference(
    tiny_model, tmp_path, variant
):
    results = {}
    for sharding in ("ddp", "fsdp"):
        folder = _write_config(tmp_path / sharding, tiny_model, **variant)
        results[sharding] = run_ranks(
            RANKS_SCRIPT, folder, sharding, world=2, args=("compare", sharding)
        )
    ddp, fsdp = results["ddp"][0], results["fsdp"][0]
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(fsdp["params"], ddp["params"], rtol=1e-4, atol=1e-5)


def test_one_rank_with_cpu_offload_is_sharded_and_trains_like_a_replica(tiny_model, tmp_path):
    folder = _write_config(tmp_path / "offload", tiny_model)
    (offloaded,) = run_ranks(
        RANKS_SCRIPT, folder, "offload", world=1, args=("compare-offload", "fsdp")
    )
    folder = _write_config(tmp_path / "replica", tiny_model)
    (replica,) = run_ranks(RANKS_SCRIPT, folder, "replica", world=1, args=("compare", "fsdp"))
    assert offloaded["sharded"] and not replica["sharded"]
    assert offloaded["losses"] == pytest.approx(replica["losses"], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(offloaded["params"], replica["params"], rtol=1e-4, atol=1e-5)


def test_gae_advantages_are_whitened_over_the_global_batch_not_per_rank(tiny_model, tmp_path):
    """PPO's GAE advantages are whitened with the mean and variance of every rank's tokens: two
    ranks get, row for row, what one rank holding all the groups gets (issue 26 item 3)."""
    from tests.workers.sharded_ranks import GROUPS, N

    folder = _write_config(tmp_path / "two", tiny_model, ppo=True)
    ranks = run_ranks(RANKS_SCRIPT, folder, "gae x2", world=2, args=("prepare", "ddp"))
    folder = _write_config(tmp_path / "one", tiny_model, ppo=True)
    (whole,) = run_ranks(RANKS_SCRIPT, folder, "gae x1", world=1, args=("prepare", "ddp"))

    for group in range(GROUPS):
        rank, index = group % 2, group // 2  # rank r holds groups r, r + 2, ...
        for k in range(N):
            torch.testing.assert_close(
                ranks[rank]["advantages"][index * N + k],
                whole["advantages"][group * N + k],
                rtol=1e-5,
                atol=1e-5,
            )


# ------------------------------------------------------------------ weights out of shards


def test_http_publish_from_shards_holds_a_bucket_and_a_tensor_not_the_model(tmp_path):
    """Rank 0 of 2 fsdp ranks publishes bf16 weights as the trainer does: its anonymous memory
    grows by one gather bucket plus the largest tensor (plus gloo's own flat copy of the
    bucket: NCCL gathers in place), while the served version lives in an unlinked spool file.
    The probe is checked on the previous way (the whole model gathered into a dict, then copied
    into the server's memory), which it must see as at least the model.

    glibc's mmap threshold is fixed at 64 KiB in the ranks, so a freed buffer leaves RSS at
    once: otherwise RSS shows the heap's high-water mark, which fragmentation inflates."""
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "wide", seed=1, hidden_size=512, num_layers=6)
    folder = _write_config(tmp_path / "run", model, dtype="bfloat16", sharding="fsdp")
    sender, _ = run_ranks(
        RANKS_SCRIPT,
        folder,
        "publish",
        world=2,
        args=("publish", "fsdp"),
        env={"MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    from tests.workers.sharded_ranks import PUBLISH_BUCKET

    bound = PUBLISH_BUCKET + sender["largest_bytes"]
    gloo = PUBLISH_BUCKET  # gloo's flat gather buffer
    slack = 1 << 20  # the interpreter, the HTTP thread, sampling
    assert sender["model_bytes"] > 4 * (bound + gloo + slack)  # a model the bound tells apart
    assert sender["whole_peak"] >= sender["model_bytes"]  # the probe sees the old way
    assert sender["streamed_peak"] <= bound + gloo + slack, (sender["streamed_peak"], bound)
    # the served version is what was gathered, byte for byte, and left no file behind
    assert sender["spool_files"] == []
    assert sender["received"].keys() == sender["whole"].keys()
    for name, tensor in sender["whole"].items():
        assert torch.equal(sender["received"][name], tensor), name
    # fp8 scales from the shards' extremes (one all-reduce) equal those of the whole tensors
    assert sender["fp8_streamed"] == sender["fp8_whole"]


def _one_layer_bytes(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    params = 2 * h * h + 2 * h * kv * head_dim + 3 * h * i + 2 * h + h + 2 * kv * head_dim
    return 4 * params * 4  # fp32 parameter + gradient + two AdamW moments


def test_fsdp_rank_holds_half_of_ddp_state_on_two_ranks(two_rank_layouts, tiny_model):
    ddp = sum(two_rank_layouts["ddp"][0]["state"].values())
    for rank in two_rank_layouts["fsdp"]:
        sharded = sum(rank["state"].values())
        assert abs(sharded - ddp / 2) <= _one_layer_bytes(tiny_model)


@pytest.fixture(scope="module")
def four_rank_fsdp(tiny_model, tmp_path_factory):
    folder = _write_config(tmp_path_factory.mktemp("fsdp4"), tiny_model)
    return run_ranks(RANKS_SCRIPT, folder, "fsdp x4", world=4, args=("compare", "fsdp"))


@pytest.fixture(scope="module")
def one_rank_state(tiny_model, tmp_path_factory):
    learner = build_learner(
        _config(tiny_model, tmp_path_factory.mktemp("one")), pad_id=0, rank=0, world_size=1
    )
    learner.update(_experience(0), seed=0)
    return local_state_bytes([learner.policy], [learner.optimizer])


def test_fsdp_rank_holds_a_quarter_of_the_state_on_four_ranks(
    four_rank_fsdp, one_rank_state, tiny_model
):
    full = sum(one_rank_state.values())
    # uneven shards (e.g. a 49-row embedding over 4 ranks) gather back to whole tensors
    assert torch.equal(four_rank_fsdp[0]["params_small_buckets"], four_rank_fsdp[0]["params"])
    for rank in four_rank_fsdp:
        assert abs(sum(rank["state"].values()) - full / 4) <= _one_layer_bytes(tiny_model)


def test_plan_state_estimate_within_10_percent_of_measured_on_1_2_4_ranks(
    tiny_model, one_rank_state, two_rank_layouts, four_rank_fsdp
):
    from rljob_operator.plan import ModelShape, model_state_bytes

    shape = ModelShape.from_config(
        json.loads((tiny_model / "config.json").read_text()), source="tiny"
    )
    measured = {
        1: [one_rank_state],
        2: [r["state"] for r in two_rank_layouts["fsdp"]],
        4: [r["state"] for r in four_rank_fsdp],
    }
    for world, ranks in measured.items():
        estimate = sum(
            model_state_bytes(
                shape.parameters(), world=world, sharded=world > 1, trainable=True, dtype_bytes=2
            ).values()
        )
        for state in ranks:
            assert abs(sum(state.values()) - estimate) <= 0.10 * estimate, (world, state)


# ------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def saved_on_two_ranks(tiny_model, tmp_path_factory):
    folder = _write_config(tmp_path_factory.mktemp("reshard"), tiny_model)
    ranks = run_ranks(RANKS_SCRIPT, folder, "fsdp save", world=2, args=("save", "fsdp"))
    return folder, ranks[0]["next_loss"]


@pytest.mark.parametrize("world", [1, 4])
def test_sharded_checkpoint_resumes_on_another_rank_count(saved_on_two_ranks, world):
    folder, uninterrupted = saved_on_two_ranks
    for stale in folder.glob("rank*.pt"):
        stale.unlink()
    ranks = run_ranks(
        RANKS_SCRIPT, folder, f"resume x{world}", world=world, args=("resume", "fsdp")
    )
    # the next step's loss of the uninterrupted 2-rank run, within float32 reduction order
    assert ranks[0]["next_loss"] == pytest.approx(uninterrupted, rel=1e-4, abs=1e-6)


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(tiny_model, tmp_path):
    folder = _write_config(tmp_path, tiny_model)
    codes = run_ranks(
        RANKS_SCRIPT,
        folder,
        "kill during save",
        world=2,
        args=("kill-save", "fsdp"),
        expect_success=False,
    )
    assert codes[1] == 9 and codes[0] != 0
    assert resume_point(folder / "ckpt") == folder / "ckpt" / "step-00000001"
    assert not (folder / "ckpt" / "step-00000002").exists()


def _first_release_checkpoint(model: Path, out: Path) -> torch.Tensor:
    """A checkpoint as the first release wrote it (full safetensors, pickled optimizer and RNG)."""
    learner = build_learner(_config(model, out), pad_id=0, rank=0, world_size=1)
    learner.update(_experience(0), seed=0)
    folder = out / "first-release" / "step-00000001"
    folder.mkdir(parents=True)
    save_model(learner.policy, str(folder / "policy.safetensors"))
    torch.save(learner.optimizer.state_dict(), folder / "optim-policy.pt")
    torch.save(capture_rng_state(), folder / "rng.pt")
    (folder / "state.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    return torch.cat([t.reshape(-1) for _, t in learner.policy.named_weights()])


def test_first_release_checkpoint_resumes_into_fsdp(tiny_model, tmp_path):
    folder = _write_config(tmp_path, tiny_model)
    expected = _first_release_checkpoint(tiny_model, tmp_path)
    ranks = run_ranks(
        RANKS_SCRIPT, folder, "first release", world=2, args=("load-first-release", "fsdp")
    )
    torch.testing.assert_close(ranks[0]["params"], expected)
    assert ranks[0]["next_loss"] == ranks[1]["next_loss"]


# ---------------------------------------------------------------------------- export


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits


def test_exported_model_loads_with_transformers_and_scores_like_the_policy(
    tiny_model, tmp_path, saved_on_two_ranks
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = build_learner(_config(tiny_model, tmp_path), pad_id=0, rank=0, world_size=1)
    learner.update(_experience(0), seed=0)
    out = export_policy(
        learner.policy.named_weights(),
        tmp_path / "hf",
        base_model=tiny_model,
        writer=True,
        shard_bytes=64 * 1024,
    )
    assert out is not None
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # sharded by size
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    AutoTokenizer.from_pretrained(out, local_files_only=True)
    batch = build_sequence_batch([[1, 5, 6]], [[8, 9]], pad_id=0)
    torch.testing.assert_close(_logits(loaded, batch), _logits(learner.policy.model, batch))

    # the same from a sharded checkpoint on disk, read tensor by tensor
    folder, _ = saved_on_two_ranks
    from_disk = export_checkpoint(folder / "ckpt", tmp_path / "hf-ckpt", base_model=tiny_model)
    reloaded = AutoModelForCausalLM.from_pretrained(from_disk, local_files_only=True)
    assert _logits(reloaded, batch).shape == _logits(loaded, batch).shape
    assert not torch.equal(
        _logits(reloaded, batch),
        _logits(AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True), batch),
    )


@pytest.mark.slow
def test_exported_model_loads_in_vllm_and_generates_like_transformers(tiny_model, tmp_path):
    from rljob_workers.engine import make_engine
    from rljob_workers.engine.hf import HFEngine

    learner = build_learner(_config(tiny_model, tmp_path, lr=1e-2), pad_id=0, rank=0, world_size=1)
    learner.update(_experience(0), seed=0)
    out = export_policy(
        learner.policy.named_weights(), tmp_path / "hf", base_model=tiny_model, writer=True
    )
    prompts = ["copy:7=", "3+4=", "next:3="]
    engine = make_engine("vllm", out, seed=0, max_model_len=64)
    try:
        fast = engine.generate(prompts, temperature=0, max_tokens=6)
    finally:
        engine.close()
    reference = HFEngine(out, seed=0).generate(prompts, temperature=0, max_tokens=6)
    assert [c.token_ids for c in fast] == [c.token_ids for c in reference]
