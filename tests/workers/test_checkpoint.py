"""Atomic checkpoints and exact resume.

Aspects under test:
- a checkpoint restores weights, optimizer state, step, policy version, data cursor and the
  torch / Python / NumPy RNG states;
- only the newest ``keep`` checkpoints remain; saving a step again replaces it;
- the resume point is the newest checkpoint that exists: a named one pruned by ``keep`` since
  gives way to the newest, a newer one (saved on SIGTERM) wins over the named one, and a named
  one on an emptied volume is an error naming the path and the fix;
- a crash while writing leaves the previous checkpoint as the newest, and no partial one;
- resume is exact: the colocated PPO run resumed from step 2 produces the same step-3 loss,
  value loss, rewards and weights as the uninterrupted run.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from rljob_workers import checkpoint as checkpoint_module
from rljob_workers.checkpoint import (
    CheckpointState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_point,
    save_checkpoint,
)
from rljob_workers.colocated import build_colocated_runtime
from rljob_workers.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ModelConfig,
    ProcessEnv,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkerConfig,
)
from rljob_workers.tinymodel import build_tiny_model


def _trained_linear(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _save(root, step, module, optimizer, keep=3):
    state = CheckpointState(step=step, policy_version=step * 2, data_cursor={"epoch": 1})
    return save_checkpoint(
        root, state, modules={"policy": module}, optimizers={"policy": optimizer}, keep=keep
    )


def test_checkpoint_roundtrip_restores_weights_optimizer_rng_and_cursor(tmp_path):
    module, optimizer = _trained_linear(0)
    optimizer.step()  # two steps: AdamW's own step count (its bias correction) is 2
    random.seed(5)
    np.random.seed(5)
    path = _save(tmp_path, 7, module, optimizer)
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    fresh, fresh_optimizer = _trained_linear(1)
    torch.rand(10), random.random(), np.random.rand()
    state = load_checkpoint(path, modules={"policy": fresh}, optimizers={"policy": fresh_optimizer})

    assert (state.step, state.policy_version, state.data_cursor) == (7, 14, {"epoch": 1})
    for mine, theirs in zip(fresh.parameters(), module.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    saved_moments = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], saved_moments)
    # the optimizer's step count is part of its state: a resumed run's bias correction goes on
    # from 2 (issue 26 item 7: the learner keeps no step counter of its own beside it)
    assert float(fresh_optimizer.state_dict()["state"][0]["step"]) == 2.0
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]


def test_checkpoint_keep_prunes_to_the_newest(tmp_path):
    module, optimizer = _trained_linear(0)
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, module, optimizer, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]


def test_resume_point_named_checkpoint_pruned_resumes_from_newest(tmp_path):
    module, optimizer = _trained_linear(0)
    named = _save(tmp_path, 2, module, optimizer, keep=2)
    for step in (4, 6, 8):
        _save(tmp_path, step, module, optimizer, keep=2)
    assert not named.exists()
    assert resume_point(tmp_path, named) == tmp_path / "step-00000008"


def test_resume_point_newer_than_named_wins(tmp_path):
    module, optimizer = _trained_linear(0)
    named = _save(tmp_path, 5, module, optimizer)
    _save(tmp_path, 7, module, optimizer)  # saved on SIGTERM after the last report
    assert resume_point(tmp_path, named) == tmp_path / "step-00000007"
    assert resume_point(tmp_path / "none") is None


def test_resume_point_named_on_emptied_volume_raises_naming_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"step-00000050.*claimName"):
        resume_point(tmp_path, tmp_path / "step-00000050")


def test_checkpoint_same_step_saved_again_replaces_it(tmp_path):
    module, optimizer = _trained_linear(0)
    _save(tmp_path, 3, module, optimizer)
    with torch.no_grad():
        module.weight.fill_(0.5)
    path = _save(tmp_path, 3, module, optimizer)
    restored, restored_optimizer = _trained_linear(1)
    load_checkpoint(path, modules={"policy": restored}, optimizers={"policy": restored_optimizer})
    assert torch.all(restored.weight == 0.5)
    assert len(list_checkpoints(tmp_path)) == 1


def test_checkpoint_crash_while_writing_keeps_previous_as_latest(tmp_path, monkeypatch):
    module, optimizer = _trained_linear(0)
    previous = _save(tmp_path, 1, module, optimizer)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # the shards are written; the disk fills up at the last file (state.json)
    monkeypatch.setattr(checkpoint_module, "_write_state", disk_full)
    with pytest.raises(OSError, match="No space"):
        _save(tmp_path, 2, module, optimizer)
    assert latest_checkpoint(tmp_path) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _ppo_config(model, checkpoint_dir, total_steps):
    return WorkerConfig(
        job_name="resume",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="ppo",
            advantage_estimator="gae",
            learning_rate=2e-3,
            critic_learning_rate=1e-2,
            batch_size=4,
            mini_batch_size=2,
            entropy_coef=0.01,
        ),
        model=ModelConfig(path=str(model)),
        task=TaskConfig(builtin="copy", num_prompts=6),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=3)),
        checkpoint=CheckpointConfig(dir=str(checkpoint_dir), every_steps=2, keep=2),
        total_steps=total_steps,
        seed=3,
    )


def test_resume_from_checkpoint_next_step_equals_uninterrupted_run(tiny_model, tmp_path):
    torch.set_num_threads(1)
    env = ProcessEnv(role="actor")
    config = _ppo_config(tiny_model, tmp_path / "ckpt", total_steps=3)
    uninterrupted = build_colocated_runtime(config, env)
    records = uninterrupted.run()

    resumed = build_colocated_runtime(config, env)
    assert resumed.resume(tmp_path / "ckpt" / "step-00000002")
    assert (resumed.step, resumed.policy_version) == (2, records[1]["policy_version"])
    record = resumed.train_step()

    assert record["loss"] != 0.0
    for key in ("loss", "value_loss", "reward_mean", "policy_version", "entropy"):
        assert record[key] == records[2][key], key
    for mine, theirs in zip(
        resumed.policy.parameters(), uninterrupted.policy.parameters(), strict=True
    ):
        assert torch.equal(mine, theirs)
