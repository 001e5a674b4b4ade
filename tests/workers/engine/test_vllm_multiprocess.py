"""vLLM rollout backend in multiprocess mode (engine core in child processes), run in a fresh
interpreter because vLLM fixes its process mode once an engine has started.

Aspects under test:
- a state-dict push reaches the worker processes through a staged safetensors directory (no raw
  tensors over the RPC), and a save_pretrained directory (tied lm_head dropped) is served correctly:
  after each push vLLM's greedy ids equal the transformers backend's and differ from before
- sampled-token log-probs still equal transformers' scoring (temperature 1)
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
    import json, sys, time
    import torch
    from rljob_workers.engine.hf import HFEngine
    from rljob_workers.engine.vllm_backend import VLLMEngine

    def greedy(engine):
        return [c.token_ids for c in engine.generate(["copy:7=", "3+4=", "next:1="],
                                                      temperature=0, max_tokens=8)]

    def moved(hf, seed):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            return {n: p + 0.3 * torch.randn(p.shape, generator=generator)
                    for n, p in hf.model.named_parameters()}

    def main(model_dir, save_dir):
        started = time.perf_counter()
        engine = VLLMEngine(model_dir, in_process=False, max_model_len=128)
        startup = time.perf_counter() - started
        hf = HFEngine(model_dir)
        result = {"startup_s": startup, "before": greedy(engine) == greedy(hf)}
        initial = greedy(engine)
        hf.load_weights(1, moved(hf, 1))
        engine.load_weights(1, dict(hf.model.named_parameters()))
        pushed = greedy(engine)
        result["dict_push"] = pushed == greedy(hf) and pushed != initial
        hf.load_weights(2, moved(hf, 2))
        hf.model.save_pretrained(save_dir)
        engine.load_weights(2, save_dir)
        result["dir_push"] = greedy(engine) == greedy(hf) != pushed
        worst = 0.0
        for c in engine.generate(["copy:7=", "3+4="], n=4, max_tokens=8, seed=3):
            scored = hf.compute_logprobs(c.prompt_ids, c.token_ids)
            worst = max([worst] + [abs(a - b) for a, b in zip(c.logprobs, scored)])
        result["max_logprob_error"] = worst
        engine.close()
        print("RESULT " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
    """
)


def test_vllm_multiprocess_weight_push_matches_hf(tiny_model_dir, tmp_path):
    script = tmp_path / "multiprocess_check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "saved")],
        capture_output=True, text=True, timeout=840, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"\nvLLM multiprocess engine started in {result['startup_s']:.1f}s")
    assert result["before"] and result["dict_push"] and result["dir_push"], result
    assert result["max_logprob_error"] < 1e-4
