# ruff: noqa: F811 - the real-node fixtures are imported from test_realnode and used by name
"""Real tasks on real pods (issue 28): aspects under test

- ``examples/math-grpo.yaml`` runs to Succeeded on the real node with no image built for it:
  - the tiny chat model is on the models claim;
  - the word problems are a parquet file on a data claim of their own, and the held-out ones a
    JSONL file beside them;
  - the reward is the example's math and format terms plus an ``http`` term scored by a
    verifier Service, a pod of the stock worker image running a small scorer;
  - the verifier is called in batches, ``status.eval`` holds the held-out accuracy, and
    ``rljob plot`` draws the curves;
- a job whose dataset has a broken line fails at once, with no restart. Its Event and condition
  quote the worker's own words (the container's termination message): the file and the line.

Needs the real node (root, scripts/setup.sh); skips naming what is missing.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e import realnode
from e2e.cluster import REPO, LocalCluster
from e2e.helpers import wait_for
from e2e.test_realnode import (  # noqa: F401 - fixtures, used by name
    _delete_job,
    _job_namespace,
    _status,
    chart_operator,
    real_cluster,
    real_job,
)
from rljob_operator.builders import DEFAULT_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

VERIFIER = r"""
import http.server, json, re, sys

class Score(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
        rewards = []
        for s in samples:
            want = s["answer"].rsplit("####", 1)[-1].strip()
            got = re.findall(r"\d+", s["response"])
            rewards.append(1.0 if got and got[-1] == want else 0.0)
        print(f"scored {len(samples)}", flush=True)
        body = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Score).serve_forever()
"""


def _verifier(namespace: str) -> list[dict[str, Any]]:
    """A verifier Deployment-free pod and its Service, on the stock worker image."""
    labels = {"app": "verifier"}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "verifier", "namespace": namespace},
            "data": {"verifier.py": VERIFIER},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "verifier", "namespace": namespace, "labels": labels},
            "spec": {
                **realnode.ON_REAL_NODE,
                "containers": [
                    {
                        "name": "verifier",
                        "image": DEFAULT_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["python", "/verifier/verifier.py"],
                        "ports": [{"containerPort": 8000}],
                        "volumeMounts": [{"name": "code", "mountPath": "/verifier"}],
                        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                    }
                ],
                "volumes": [{"name": "code", "configMap": {"name": "verifier"}}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "verifier", "namespace": namespace},
            "spec": {"selector": labels, "ports": [{"port": 8000, "targetPort": 8000}]},
        },
    ]


def _apply(cluster: LocalCluster, docs: list[dict[str, Any]]) -> None:
    body = {"apiVersion": "v1", "kind": "List", "items": docs}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def _math_job(name: str, steps: int) -> dict[str, Any]:
    job = real_job("math-grpo", steps=steps)
    job["metadata"]["name"] = name
    task = job["spec"]["task"]
    task["dataset"].update(path="/data/train.parquet", volume={"claimName": "data"})
    task["eval"]["dataset"].update(path="/data/test.jsonl", volume={"claimName": "data"})
    task["eval"].update(everySteps=5, samples=16)
    return job


@pytest.mark.timeout(1500)
def test_the_math_example_runs_on_real_pods_with_a_dataset_claim_and_a_verifier_service(
    real_cluster: LocalCluster, chart_operator: str, tmp_path_factory: Any
) -> None:
    from rljob_workers.tinymodel import build_tiny_model
    from rljob_workers.wordproblems import generate_problems, write_problems

    root = Path(tmp_path_factory.mktemp("volumes"))
    ns = _job_namespace(real_cluster, root)
    build_tiny_model(root / f"{ns}-models" / "tiny-chat", chat=True)
    data = root / f"{ns}-data"
    write_problems(data / "train.parquet", generate_problems(256, seed=0))
    write_problems(data / "test.jsonl", generate_problems(32, seed=1))
    for path in [data, *data.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    _apply(
        real_cluster,
        realnode.claim_manifests(ns, [("data", data, "ReadOnlyMany")]) + _verifier(ns),
    )
    job = _math_job("math", steps=12)
    job["spec"]["task"]["reward"]["terms"].append(
        {"type": "http", "url": f"http://verifier.{ns}.svc:8000/score", "weight": 0.5}
    )
    real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(job))
    try:
        wait_for(
            lambda: _status(real_cluster, ns, "math").get("phase") in ("Succeeded", "Failed"),
            1200,
            "the math job to finish",
        )
        status = _status(real_cluster, ns, "math")
        assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
        assert status["step"] == 12
        evaluation = status["eval"]
        assert evaluation["step"] == 12 and evaluation["samples"] == 16, evaluation
        assert 0.0 <= evaluation["accuracy"] <= 1.0
        scored = real_cluster.kubectl("logs", "-n", ns, "verifier").stdout
        # (the verifier's threads print concurrently: lines may run together)
        batches = [int(n) for n in re.findall(r"scored (\d+)", scored)]
        # every step's samples (16 prompts x 8) and every evaluation's 16 went to the verifier
        assert sum(batches) >= 12 * 16 * 8, batches[:20]
        assert max(batches) <= 32  # the term's batch size
        png = Path(tmp_path_factory.mktemp("plot")) / "math.png"
        plotted = subprocess.run(
            [str(REPO / ".venv/bin/rljob"), "plot", "math", "-n", ns, "-o", str(png)],
            env=real_cluster.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert plotted.returncode == 0 and png.is_file(), plotted.stderr
    finally:
        _delete_job(real_cluster, ns, "math")
    # a broken dataset: Failed at once, naming the file and the line, no restart
    (data / "broken.jsonl").write_text(
        json.dumps({"question": "Tom has 1 pen.", "answer": "#### 1"}) + "\n{not json\n"
    )
    (data / "broken.jsonl").chmod(0o644)
    broken = _math_job("broken", steps=5)
    broken["spec"]["task"]["dataset"]["path"] = "/data/broken.jsonl"
    real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(broken))
    try:
        wait_for(
            lambda: _status(real_cluster, ns, "broken").get("phase") == "Failed",
            600,
            "the job with a broken dataset to fail",
        )
        status = _status(real_cluster, ns, "broken")
        assert status["restarts"] == {"rollout": 0, "trainer": 0}, status
        condition = {c["type"]: c for c in status["conditions"]}["Failed"]
        assert "/data/broken.jsonl, line 2: not valid JSON" in condition["message"], condition
        assert "exit code 2" in condition["message"]
        events = real_cluster.kubectl(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            "involvedObject.name=broken",
            "-o",
            "json",
        ).stdout
        assert "line 2" in events
    finally:
        _delete_job(real_cluster, ns, "broken")
