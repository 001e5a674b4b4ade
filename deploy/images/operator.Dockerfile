# syntax=docker/dockerfile:1
# The operator image: Python 3.11 with the [operator] extra only (kopf, kubernetes, prometheus-client,
# pydantic); no torch, no vLLM. Build from the repository root (see README.md beside this file):
#   docker build -f deploy/images/operator.Dockerfile -t ghcr.io/rljob/rljob-operator:0.1.0 .

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Versions come from the project's lock file (the same pins the tests ran with).
COPY requirements/lock.txt requirements/lock.txt
RUN python -m venv /opt/rljob \
 && /opt/rljob/bin/pip install "setuptools==78.1.1"
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY workers/ workers/
RUN /opt/rljob/bin/pip install --no-build-isolation -c requirements/lock.txt ".[operator]" \
 && /opt/rljob/bin/python -m compileall -q /opt/rljob/lib/python3.11/site-packages

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="rljob-operator" \
      org.opencontainers.image.description="Kubernetes operator for LLM RL post-training jobs (RLJob)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
# kopf calls getpass.getuser() at start: the runtime uid needs a passwd entry
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /home/rljob rljob
COPY --from=build /opt/rljob /opt/rljob
ENV PATH=/opt/rljob/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# 65532: the chart's runAsUser; the root filesystem can be read-only (bytecode is precompiled)
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["rljob-operator"]
CMD ["--all-namespaces"]
