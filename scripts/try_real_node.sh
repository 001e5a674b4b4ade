#!/usr/bin/env bash
# Try the operator on a real node, end to end (docs/operations/real-node.md): a local control plane with
# one real node (containerd + kubelet in a network namespace), the chart installed with the
# operator image built here, examples/grpo-colocated.yaml run with `rljob run` and followed to
# Succeeded, then everything torn down. Needs root and scripts/setup.sh (it builds and imports
# the images). Usage: scripts/try_real_node.sh [STEPS]   (default 30)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"
steps=${1:-30}
dir=${RLJOB_CLUSTER_DIR:-/tmp/rljob-real-node}
py=.venv/bin/python
source "$here/versions.env"
source "$here/lib.sh"
helm="$CACHE/bin/helm-$HELM_VERSION/helm"
start=$SECONDS
trap '$py -m e2e.cluster down --dir "$dir"' EXIT

$py -m e2e.cluster up --real-node --gpu-nodes 1 --dir "$dir"
export KUBECONFIG="$dir/kubeconfig"
echo "[try] helm install (operator image ghcr.io/rljob/rljob-operator:0.1.0, built here)"
"$helm" install rljob helm/rljob-operator -n rljob-system --create-namespace --wait --timeout 300s \
  --set image.pullPolicy=Never --set replicaCount=1 \
  --set-json 'nodeSelector={"rljob.io/real-node":"true"}' \
  --set-json 'tolerations=[{"key":"rljob.io/real-node","operator":"Exists","effect":"NoSchedule"}]'
echo "[try] namespace demo: the tiny model and a checkpoint volume"
$py e2e/realnode.py prepare demo "$dir/volumes" | "$CACHE/bin/kubernetes-$K8S_VERSION/kubectl" apply -f -
$py e2e/realnode.py job examples/grpo-colocated.yaml "$steps" > "$dir/grpo-colocated.yaml"
echo "[try] rljob run (Ctrl-C detaches; the job keeps running)"
.venv/bin/rljob run "$dir/grpo-colocated.yaml" -n demo
echo "[try] finished in $((SECONDS - start))s; tearing down"
