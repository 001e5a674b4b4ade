"""Policy versions across a trainer-group restart, on two real gloo ranks: aspects under test

- a group resumed from a checkpoint older than the newest version it published numbers its
  versions past that one (both ranks agree): no version names two sets of weights;
- experience generated with the newest published weights is not "behind -1" (staleness is
  never negative) after the restart;
- experience ahead of the trainer's version (the note lost) moves the trainer past it;
- rank 1 trains on rank 0's batch (the same samples, rewards and staleness in its records).
"""

from __future__ import annotations

from pathlib import Path

from rljob_workers.config import CheckpointConfig, Endpoints, ProcessEnv
from rljob_workers.tinymodel import build_tokenizer
from rljob_workers.trainer_worker import TrainerWorker
from rljob_workers.transport import ExperienceClient
from tests.workers.gloo_ranks import free_port, run_two_ranks
from tests.workers.test_disaggregated import TOKEN, _config, _synthetic_group, tiny_model

__all__ = ["tiny_model"]
SCRIPT = Path(__file__).with_name("trainer_resume_ranks.py")


def test_trainer_group_resumed_from_older_checkpoint_never_repeats_a_version(
    tiny_model: Path, tmp_path: Path
) -> None:
    base = _config(
        tiny_model,
        tmp_path,
        batch_size=1,
        batch_size_mini=1,
        total_steps=10,
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=2),
    )
    for phase in ("first", "resumed"):
        endpoints = Endpoints(
            experience_port=free_port(),
            weights_port=free_port(),
            rendezvous_port=free_port(),
            metrics_port=0,
        )
        config = base.model_copy(update={"endpoints": endpoints})
        (tmp_path / f"config-{phase}.json").write_text(config.dump())

    ranks = run_two_ranks(str(SCRIPT), tmp_path, "trainer restart", timeout=600)

    for seen in ranks:
        assert seen["first"]["versions"] == [1, 2, 3]
        assert seen["resumed"]["start"] == (2, 4)  # step of the checkpoint, past version 3
        assert seen["resumed"]["versions"] == [5]
    leader = ranks[0]["resumed"]
    assert leader["behind"] == [1.0]  # version-3 experience, trained by version 4
    for phase, steps in (("first", 3), ("resumed", 1)):  # rank 1 trained on rank 0's batches
        assert ranks[1][phase]["batches"] == ranks[0][phase]["batches"]
        assert [b["samples"] for b in ranks[1][phase]["batches"]] == [4] * steps


def test_trainer_experience_ahead_of_its_version_moves_past_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Without the note (e.g. ephemeral checkpoints), experience newer than the trainer's
    version moves the trainer past it instead of training it as "behind -3"."""
    config = _config(tiny_model, tmp_path, batch_size=1, batch_size_mini=1, total_steps=5)
    env = ProcessEnv(role="trainer", config_path=str(tmp_path / "config.json"), token=TOKEN)
    prompt = list(build_tokenizer()("copy:4=")["input_ids"])
    worker = TrainerWorker(config, env)
    client = ExperienceClient(f"http://127.0.0.1:{config.endpoints.experience_port}", TOKEN)
    try:
        client.send(_synthetic_group("ahead", 3, prompt), timeout_s=10)
        record = worker.train_step()
    finally:
        client.close()
        worker.close()
    assert record["policy_lag_versions"] == 1.0
    assert record["policy_version"] == 5
