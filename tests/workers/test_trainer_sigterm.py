"""The disaggregated trainer on SIGTERM (what a graceful pod deletion sends): aspects under test

- SIGTERM between steps stops the loop (no further step) and rank 0 saves a checkpoint of the
  last finished step, reported to the operator in the heartbeat, so the restarted group resumes
  from it instead of from the last periodic checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rljob_workers.checkpoint import latest_checkpoint
from rljob_workers.config import CheckpointConfig, ProcessEnv
from rljob_workers.control import stop_on_sigterm
from rljob_workers.tinymodel import build_tokenizer
from rljob_workers.trainer_worker import TrainerWorker
from rljob_workers.transport import ExperienceClient
from tests.workers.test_disaggregated import TOKEN, _config, _synthetic_group, tiny_model

__all__ = ["tiny_model"]


def test_trainer_sigterm_between_steps_checkpoints_last_step_and_stops(
    tiny_model: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    config = _config(
        tiny_model,
        tmp_path,
        batch_size=1,
        batch_size_mini=1,
        total_steps=5,
        checkpoint=CheckpointConfig(dir=str(ckpt), every_steps=50),
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(config.dump())
    env = ProcessEnv(role="trainer", config_path=str(config_path), token=TOKEN)
    prompt = list(build_tokenizer()("copy:4=")["input_ids"])
    worker = TrainerWorker(config, env)
    client = ExperienceClient(f"http://127.0.0.1:{config.endpoints.experience_port}", TOKEN)
    try:
        client.send(_synthetic_group("a", 0, prompt), timeout_s=10)
        worker.train_step()
        assert latest_checkpoint(ckpt) is None  # every 50 steps: nothing saved yet
        with stop_on_sigterm(worker.stop, "checkpointing after the current step"):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not worker.stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            records = worker.run()
    finally:
        client.close()
        worker.close()
    assert records == []
    assert worker.step == 1
    saved = latest_checkpoint(ckpt)
    assert saved is not None and saved.name.endswith("00000001")
    progress = json.loads((tmp_path / "progress" / "trainer-0.json").read_text())
    assert progress["last_checkpoint"] == str(saved)
    assert progress["done"] is False
