"""The image builder (scripts/build_images.py, no Docker, no registry): aspects under test

- the worker image's environment switches torch.compile off: vLLM's logprob kernel (compiled through
  inductor even with ``enforce_eager``) then runs without a C++ compiler and gives the same counts,
  while without the switch it dies looking for one (the crash of a first real-pod run);
- the OS layer gives the runtime uids a passwd entry (kopf calls ``getpass.getuser()`` at start);
- the project layer's key follows the sources and nothing else (a source change rebuilds only it;
  the heavy environment layer is keyed by the dependency venv, i.e. the lock file);
- the OCI archive the builder streams into containerd is a valid image layout.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import build_images  # noqa: E402

COUNT = """
import torch
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
x = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.2, 0.1]])
print(batched_count_greater_than(x, torch.tensor([[0.4], [0.25]])).tolist())
"""


def _worker_env() -> dict[str, str]:
    image = next(i for i in build_images.images() if i.ref == build_images.WORKER_REF)
    env = image.config["Env"]
    assert isinstance(env, list)
    return dict(str(e).split("=", 1) for e in env)


def _run_without_compiler(
    extra: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": str(tmp_path),  # no cc, c++, g++ or clang anywhere
        "CXX": str(tmp_path / "no-compiler"),
        "HOME": str(tmp_path),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "VLLM_TARGET_DEVICE": "cpu",
        **extra,
    }
    return subprocess.run(
        [sys.executable, "-c", COUNT], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_worker_image_env_runs_vllm_logprob_kernel_without_a_compiler(tmp_path: Path) -> None:
    env = _worker_env()
    assert env["TORCH_COMPILE_DISABLE"] == "1"
    result = _run_without_compiler({"TORCH_COMPILE_DISABLE": "1"}, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[2, 1]"


@pytest.mark.slow
def test_without_the_switch_vllm_logprob_kernel_needs_a_compiler(tmp_path: Path) -> None:
    result = _run_without_compiler({}, tmp_path)
    assert result.returncode != 0
    assert "Compiler" in result.stderr or "compiler" in result.stderr


def test_os_layer_gives_runtime_uids_a_passwd_entry() -> None:
    layer = build_images.os_layer()
    if not layer.path.exists():
        pytest.skip(f"{layer.path} not built (scripts/setup.sh builds it)")
    with tarfile.open(layer.path) as tar:
        member = next(m for m in tar.getmembers() if m.name.lstrip("./") == "etc/passwd")
        f = tar.extractfile(member)
        assert f is not None
        passwd = f.read().decode()
    uids = {int(line.split(":")[2]) for line in passwd.splitlines() if line}
    assert {65532, 1000} <= uids


def test_project_layer_key_follows_the_sources_only(tmp_path: Path, monkeypatch) -> None:
    before = build_images.project_layer().key
    fake = tmp_path / "operator" / "rljob_operator"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("A = 1\n")
    (tmp_path / "workers" / "rljob_workers").mkdir(parents=True)
    monkeypatch.setattr(build_images, "REPO", tmp_path)
    first = build_images.project_layer().key
    (fake / "x.py").write_text("A = 2\n")
    assert build_images.project_layer().key != first
    (tmp_path / "README.md").write_text("docs change\n")
    (fake / "x.py").write_text("A = 1\n")
    assert build_images.project_layer().key == first
    assert first != before


def test_oci_archive_is_a_valid_image_layout(tmp_path: Path, monkeypatch) -> None:
    layer_file = tmp_path / "layer.tar"
    with tarfile.open(layer_file, "w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    digest = "sha256:" + hashlib.sha256(layer_file.read_bytes()).hexdigest()
    layer = build_images.Layer("t", "k", lambda _t, _o: None)
    monkeypatch.setenv("RLJOB_CACHE", str(tmp_path))
    layer.path.parent.mkdir(parents=True)
    layer_file.rename(layer.path)
    image = build_images.Image("example.org/t:1", [layer], {"User": "1:1"})
    buf = io.BytesIO()
    manifest_digest = build_images.write_oci_archive(image, [digest], buf)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    entry = index["manifests"][0]
    assert entry["digest"] == manifest_digest
    assert entry["annotations"]["io.containerd.image.name"] == "example.org/t:1"
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(files[f"blobs/sha256/{manifest_digest.split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["rootfs"]["diff_ids"] == [digest]
    assert config["config"]["User"] == "1:1"
