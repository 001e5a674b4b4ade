"""One TRL ``GRPOTrainer`` run, the peer side of ``bench.trl_bench`` (never imported by it).

Runs in its own process with the bench's TRL environment on ``PYTHONPATH`` (``trl`` is not a
dependency of this project), on the tiny model and the built-in task and reward of our workers, with
the settings ``bench.trl_bench`` passes as JSON. Writes one JSON result: start-up phases, per-step
generate/train times, the reward of every generation batch, peak RSS.
Usage: python bench/trl_grpo_run.py SETTINGS.json RESULT.json
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from rljob_workers.startup import process_started_at

PROCESS_START = process_started_at() or time.time()


def main(settings_path: str, result_path: str) -> int:
    settings = json.loads(Path(settings_path).read_text())
    phases: dict[str, float] = {}
    mark = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rljob_workers.config import TaskConfig
    from rljob_workers.tasks import load_task_data

    torch.set_num_threads(settings["threads"])
    phases["imports_s"] = time.time() - PROCESS_START
    mark = time.time()
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    phases["model_load_s"] = time.time() - mark

    task = load_task_data(TaskConfig(builtin=settings["task"], num_prompts=settings["num_prompts"]))
    answers = dict(zip(task.prompts, task.answers, strict=True))
    batch_rewards: list[float] = []

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        scores = [task.reward(c, answers[p]) for p, c in zip(prompts, completions, strict=True)]
        batch_rewards.append(sum(scores) / len(scores))
        return scores

    reward.__name__ = "exact_match"
    timings: dict[str, list[float]] = {"generate_s": [], "score_s": []}
    step_ends: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer whose generation (and generate + score + old/ref log-probs) is timed."""

        def _generate(self, prompts: list[Any]) -> Any:
            start = time.perf_counter()
            out = super()._generate(prompts)
            timings["generate_s"].append(time.perf_counter() - start)
            return out

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timings["score_s"].append(time.perf_counter() - start)
            return out

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            step_ends.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            step_ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=settings["output_dir"],
        use_cpu=True,
        seed=settings["seed"],
        max_steps=settings["optimizer_steps"],
        per_device_train_batch_size=settings["mini_batch_completions"],
        gradient_accumulation_steps=1,
        steps_per_generation=settings["minibatches"],
        num_iterations=settings["epochs"],
        num_generations=settings["group_size"],
        max_completion_length=settings["max_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=0,
        beta=settings["kl_coef"],
        epsilon=settings["clip"],
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_epsilon=1e-8,
        max_grad_norm=settings["max_grad_norm"],
        loss_type="bnpo",
        scale_rewards="group",
        logging_steps=settings["optimizer_steps"],
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
    )
    dataset = Dataset.from_dict({"prompt": list(task.prompts)})
    mark = time.time()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    phases["trainer_init_s"] = time.time() - mark
    trainer.train()
    per_gen = settings["epochs"] * settings["minibatches"]
    bounds = step_ends[::per_gen]
    step_s = [b - a for a, b in itertools.pairwise(bounds)]
    phases["first_step_s"] = step_s[0] if step_s else float("nan")
    result = {
        "phases": phases,
        "loop_s": step_ends[-1] - step_ends[0],
        "step_s": step_s,
        "generate_s": timings["generate_s"],
        "generate_score_s": timings["score_s"],
        "batch_rewards": batch_rewards,
        "optimizer_steps": trainer.state.global_step,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "loop_end_unix": time.time() - (time.perf_counter() - step_ends[-1]),
        "process_start_unix": PROCESS_START,
    }
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
