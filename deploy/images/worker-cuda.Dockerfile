# syntax=docker/dockerfile:1
# The CUDA worker image: vLLM's GPU build 0.32.0 (it pins torch==2.13.0, a CUDA 13 build, the same
# torch as every other environment here) and this project's workers, versions from
# requirements-cuda.lock beside this file. Needs an NVIDIA driver for CUDA 13 (>= 580) on the node.
# Build from the repository root:
#   docker build -f deploy/images/worker-cuda.Dockerfile -t ghcr.io/rljob/rljob-worker:0.1.0-cuda .

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS build
COPY --from=uv /uv /usr/local/bin/uv
# Ubuntu 24.04 ships Python 3.12; the project is 3.11, so uv installs a pinned standalone CPython.
ENV UV_LINK_MODE=copy UV_NO_CACHE=1 UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed
WORKDIR /src
RUN uv python install 3.11.13 \
 && uv venv --python 3.11.13 /opt/rljob
COPY deploy/images/requirements-cuda.lock requirements-cuda.lock
RUN uv pip install --python /opt/rljob/bin/python -r requirements-cuda.lock
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY workers/ workers/
RUN uv pip install --python /opt/rljob/bin/python --no-deps . \
 && /opt/rljob/bin/python -m compileall -q -j 0 /opt/rljob/lib/python3.11/site-packages \
 && /opt/rljob/bin/python -c "import torch, vllm, rljob_workers; print(torch.__version__, vllm.__version__)"

FROM nvidia/cuda:13.0.1-base-ubuntu24.04
LABEL org.opencontainers.image.title="rljob-worker" \
      org.opencontainers.image.description="RLJob rollout/trainer worker (vLLM CUDA + PyTorch, NCCL)" \
      org.opencontainers.image.version="0.1.0-cuda" \
      org.opencontainers.image.licenses="Apache-2.0"
# NVIDIA_VISIBLE_DEVICES=void: the CUDA base sets "all", which makes the NVIDIA container runtime
# hand every GPU of the node to a container that requested none; the device plugin sets the
# devices a pod was given, so a pod sees those and no others
RUN useradd --uid 65532 --user-group --create-home --home-dir /home/rljob rljob
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/rljob /opt/rljob
ENV PATH=/opt/rljob/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/rljob \
    NVIDIA_VISIBLE_DEVICES=void \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
WORKDIR /home/rljob
ENTRYPOINT ["python", "-m", "rljob_workers.main"]
