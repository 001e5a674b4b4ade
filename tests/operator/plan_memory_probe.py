"""Measure the peak resident-memory growth of one learner step on a model (run as a script).

Usage: python plan_memory_probe.py MANIFEST MODEL_DIR PROMPT_TOKENS; prints JSON
``{"peak_bytes": ...}``: the highest RSS (sampled every 0.5 ms from /proc/self/statm) minus the
RSS before the policy was loaded, over loading the learner's models and one update. A throwaway
load runs first, so imports and lazy set-up are not counted.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from rljob_operator.api import parse_rljob, resolve_topology
from rljob_operator.builders import JobRef, build_worker_config
from rljob_workers.learner import Experience, build_learner
from rljob_workers.policy import load_causal_lm, pad_token_id

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def main() -> None:
    manifest, model_dir, prompt_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    job = parse_rljob(yaml.safe_load(Path(manifest).read_text()))
    topology, _ = resolve_topology(job.spec)
    config = build_worker_config(
        job.spec, JobRef("probe", "default", ""), topology, model_path=model_dir
    )
    n = config.rollout.sampling.n
    rows = config.algorithm.batch_size * n
    answer = job.spec.rollout.sampling.max_tokens
    experience = Experience(
        prompt_ids=[[3 + (i + j) % 40 for j in range(prompt_tokens)] for i in range(rows)],
        response_ids=[[3 + (i * j) % 40 for j in range(answer)] for i in range(rows)],
        behaviour_logprobs=[[-1.0] * answer for _ in range(rows)],
        scores=[float(i % 2) for i in range(rows)],
    )
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    warm = load_causal_lm(model_dir)  # imports and lazy initialisation are not the job's memory
    del warm
    gc.collect()
    base = rss()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    learner = build_learner(config, pad_id=pad_token_id(model_dir), rank=0, world_size=1)
    learner.update(experience, seed=0)
    stop.set()
    thread.join()
    peak[0] = max(peak[0], rss())
    print(json.dumps({"peak_bytes": peak[0] - base}))


if __name__ == "__main__":
    main()
