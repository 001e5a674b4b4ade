"""Behaviour, old and new log-probs describe one distribution when sampling is truncated.

Review finding (RL correctness round 3, item 2): with ``sampling.topP < 1`` the engine reported
log-probs of the truncated (nucleus) distribution while the learner scored the full softmax, so
at the same weights the two sat ~0.2 nats apart and every ratio and correction was off by that.

Aspects under test:
- at the same weights, the learner's old log-probs equal the transformers engine's behaviour
  log-probs for top-p, top-k, min-p and all three together (the gap metric reads ~0), while a
  full-softmax scorer of the same rows is far off (what the learner did before);
- an update with a truncated policy has finite loss, entropy and gradients, and its first
  minibatch starts at ratio 1;
"""

from __future__ import annotations

import pytest
import torch

from rljob_workers.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkerConfig,
)
from rljob_workers.engine.hf import HFEngine
from rljob_workers.learner import Experience, build_learner
from rljob_workers.policy import PolicyModel, build_sequence_batch

PROMPTS = ["copy:7=", "next:3=", "3+4=", "copy:2="]
N = 4
SETTINGS = {
    "top_p": {"top_p": 0.8},
    "top_k": {"top_k": 4},
    "min_p": {"min_p": 0.7},
    "all": {"top_p": 0.9, "top_k": 6, "min_p": 0.5},
}


def _config(model, tmp_path, temperature: float, epochs: int = 2, **sampling) -> WorkerConfig:
    return WorkerConfig(
        job_name="sampling-test",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="grpo",
            advantage_estimator="grpo",
            learning_rate=1e-3,
            group_size=N,
            batch_size=len(PROMPTS),
            mini_batch_size=len(PROMPTS),
            ppo_epochs=epochs,
        ),
        model=ModelConfig(path=str(model)),
        task=TaskConfig(builtin="copy", num_prompts=16),
        rollout=RolloutConfig(
            engine="hf",
            sampling=SamplingConfig(n=N, max_tokens=6, temperature=temperature, **sampling),
        ),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=0),
        output_dir=str(tmp_path),
    )


def _experience(engine: HFEngine, temperature: float, **sampling) -> Experience:
    completions = engine.generate(
        PROMPTS, n=N, max_tokens=6, temperature=temperature, seed=11, **sampling
    )
    return Experience(
        [c.prompt_ids for c in completions],
        [c.token_ids for c in completions],
        [c.logprobs for c in completions],
        [float(i % 2) for i in range(len(completions))],
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    torch.set_num_threads(1)
    return HFEngine(tiny_model_dir, seed=0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_old_logprobs_equal_behaviour_logprobs_under_truncated_sampling(
    name, engine, tiny_model_dir, tmp_path
):
    sampling = SETTINGS[name]
    experience = _experience(engine, 1.5, **sampling)
    learner = build_learner(
        _config(tiny_model_dir, tmp_path, 1.5, **sampling), pad_id=0, rank=0, world_size=1
    )
    prepared = learner.prepare(experience)
    assert prepared is not None
    mask = prepared.batch.response_mask.bool()
    gap = (prepared.old_logp - prepared.behaviour_logp).abs()[mask]
    assert float(gap.max()) < 1e-4, name

    # the full softmax (what the learner scored before): the same rows, far apart
    full = PolicyModel.from_pretrained(tiny_model_dir, temperature=1.5).eval()
    batch = build_sequence_batch(
        experience.prompt_ids, experience.response_ids, pad_id=0, device="cpu"
    )
    with torch.no_grad():
        full_logp, _ = full(batch)
    assert float((full_logp - prepared.behaviour_logp).abs()[mask].mean()) > 0.01, name


def test_update_with_truncated_policy_is_finite_and_starts_at_ratio_one(
    engine, tiny_model_dir, tmp_path
):
    sampling = SETTINGS["all"]
    experience = _experience(engine, 1.0, **sampling)
    config = _config(tiny_model_dir, tmp_path, 1.0, epochs=1, **sampling)
    learner = build_learner(config, pad_id=0, rank=0, world_size=1)
    metrics = learner.update(experience, seed=0)
    assert metrics["optimizer_steps"] == 1.0
    for key in ("loss", "entropy", "grad_norm", "approx_kl"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["grad_norm"] > 0
    # one minibatch, one epoch: the ratio is 1 (k3 of it 0) and nothing is clipped
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["behaviour_logprob_gap"] < 1e-4
