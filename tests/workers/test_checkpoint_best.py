"""The best checkpoint by score, kept besides the newest ``keep`` (``best.json``).

Aspects under test:
- the best-scoring checkpoint survives pruning when it is older than the newest ``keep``; the
  others are pruned as before, and ``best.json`` names it with its step and score;
- a higher score moves ``best.json`` (and the old best is pruned once out of the newest
  ``keep``), so does an equal one (the newer policy trained longer); a lower one does not;
- checkpoints without a score (None, NaN) never become best; ``keep_best=False`` keeps only the
  newest ``keep`` and writes no ``best.json``;
- a best checkpoint removed by hand is forgotten (``best_checkpoint`` is None) and the next
  scored save becomes best; a step saved again takes its new score;
- the score travels in ``state.json`` and comes back from ``load_checkpoint``.
"""

from __future__ import annotations

import json
import math
import shutil

import torch
from torch import nn

from rljob_workers.checkpoint import (
    CheckpointState,
    best_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _parts() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    return module, torch.optim.AdamW(module.parameters(), lr=0.1)


def _save(root, step, score, *, keep=2, keep_best=True):
    module, optimizer = _parts()
    return save_checkpoint(
        root,
        CheckpointState(step=step, policy_version=step, score=score),
        modules={"policy": module},
        optimizers={"policy": optimizer},
        keep=keep,
        keep_best=keep_best,
    )


def _names(root) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def test_the_best_survives_pruning_beside_the_newest(tmp_path):
    for step, score in [(10, 0.2), (20, 0.9), (30, 0.5), (40, 0.1), (50, 0.05)]:
        _save(tmp_path, step, score)
    assert _names(tmp_path) == ["step-00000020", "step-00000040", "step-00000050"]
    best = best_checkpoint(tmp_path)
    assert best is not None and (best.step, best.score) == (20, 0.9)
    assert best.path == tmp_path / "step-00000020"
    assert json.loads((tmp_path / "best.json").read_text())["name"] == "step-00000020"


def test_a_higher_score_moves_the_best_and_the_old_one_is_pruned(tmp_path):
    for step, score in [(10, 0.5), (20, 0.5), (30, 0.4)]:
        _save(tmp_path, step, score)
    best = best_checkpoint(tmp_path)
    assert best is not None and best.step == 20
    for step, score in [(40, 0.7), (50, 0.6)]:
        _save(tmp_path, step, score)
    best = best_checkpoint(tmp_path)
    assert best is not None and best.step == 40  # 20 tied 10 and took it, 40 beat 20
    assert _names(tmp_path) == ["step-00000040", "step-00000050"]


def test_unscored_checkpoints_never_become_best(tmp_path):
    _save(tmp_path, 10, None)
    _save(tmp_path, 20, math.nan)
    assert best_checkpoint(tmp_path) is None
    assert not (tmp_path / "best.json").exists()
    _save(tmp_path, 30, 0.3)
    for step in (40, 50):
        _save(tmp_path, step, None)
    assert _names(tmp_path) == ["step-00000030", "step-00000040", "step-00000050"]


def test_keep_best_off_keeps_only_the_newest(tmp_path):
    for step, score in [(10, 0.9), (20, 0.1), (30, 0.1)]:
        _save(tmp_path, step, score, keep_best=False)
    assert _names(tmp_path) == ["step-00000020", "step-00000030"]
    assert best_checkpoint(tmp_path) is None


def test_a_best_removed_by_hand_is_forgotten_and_replaced(tmp_path):
    _save(tmp_path, 10, 0.9)
    _save(tmp_path, 20, 0.1)
    shutil.rmtree(tmp_path / "step-00000010")
    assert best_checkpoint(tmp_path) is None
    _save(tmp_path, 30, 0.2)
    best = best_checkpoint(tmp_path)
    assert best is not None and best.step == 30


def test_a_step_saved_again_takes_its_new_score(tmp_path):
    _save(tmp_path, 10, 0.9)
    _save(tmp_path, 10, 0.4)  # a resumed run repeating step 10
    best = best_checkpoint(tmp_path)
    assert best is not None and (best.step, best.score) == (10, 0.4)


def test_the_score_comes_back_on_load(tmp_path):
    path = _save(tmp_path, 10, 0.625)
    module, optimizer = _parts()
    state = load_checkpoint(path, modules={"policy": module}, optimizers={"policy": optimizer})
    assert state.score == 0.625


def test_a_colocated_run_whose_reward_collapses_keeps_its_best_checkpoint(tmp_path):
    """The learner end to end (real tiny model, HF engine, real checkpoints): the task reward is
    1 until step 6 and 0 after (a collapse forced from outside the policy). The watch reports
    the collapse at step 7, the checkpoint of step 6 stays as best while keep=2 prunes the rest,
    and the step records carry what the heartbeat sends."""
    from rljob_workers.colocated import build_colocated_runtime
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        CollapseConfig,
        ModelConfig,
        ProcessEnv,
        Progress,
        RolloutConfig,
        SamplingConfig,
        TaskConfig,
        WorkerConfig,
    )
    from rljob_workers.health import health_fields
    from rljob_workers.tasks import TaskData
    from rljob_workers.tinymodel import build_tiny_model

    torch.set_num_threads(1)
    config = WorkerConfig(
        job_name="collapse",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="grpo", advantage_estimator="grpo", batch_size=2, mini_batch_size=2, group_size=2
        ),
        model=ModelConfig(path=str(build_tiny_model(tmp_path / "tiny", seed=0))),
        task=TaskConfig(builtin="copy", num_prompts=4),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=2)),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=2, keep=2),
        collapse=CollapseConfig(window_steps=4, smoothing_steps=1, reward_drop=0.3),
        total_steps=12,
    )
    runtime = build_colocated_runtime(config, ProcessEnv(role="actor"))
    task = runtime.task
    runtime.task = TaskData(
        prompts=task.prompts,
        answers=task.answers,
        reward=lambda response, answer: 1.0 if runtime.step < 6 else 0.0,
    )
    records = runtime.run()
    collapsed = [r["step"] for r in records if r["collapsed"]]
    assert collapsed == list(range(7, 13))
    assert records[6]["collapse"]["peak_step"] == 6 and records[6]["collapse"]["active"]
    best = best_checkpoint(tmp_path / "ckpt")
    assert best is not None and (best.step, best.score) == (6, 1.0)
    assert _names(tmp_path / "ckpt") == ["step-00000006", "step-00000010", "step-00000012"]
    beat = Progress(role="actor", time=1.0, step=12, **health_fields(records[-1]))
    assert beat.best_checkpoint == str(best.path) and beat.best_reward == 1.0
    assert beat.collapse is not None and beat.collapse.active and beat.collapse.step == 7
