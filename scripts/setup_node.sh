#!/usr/bin/env bash
# The real node's set-up (DESIGN.md §6): Debian packages (containerd, runc, CNI plugins, iptables,
# mmdebstrap, catatonit; prometheus for promtool), then the images built without Docker (scripts/build_images.py: cached
# layers keyed by content) and imported into the containerd store the real node uses.
# The node's Go binaries (kubelet, kube-proxy, coredns) come from build_controlplane.sh.
# Skipped with a line saying why when not root or RLJOB_REAL_NODE=0; the real-node tests then skip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/lib.sh"

if [ "${RLJOB_REAL_NODE:-1}" = 0 ]; then
  _log "real node: skipped (RLJOB_REAL_NODE=0)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  _log "real node: skipped (needs root for containerd, network namespaces and cgroups)"
  exit 0
fi

# prometheus: its promtool checks and unit-tests the chart's alert rules (tests/deploy)
PACKAGES="containerd runc containernetworking-plugins iptables mmdebstrap catatonit prometheus"
apt_packages() {
  local missing=()
  for p in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] && return 0
  echo "installing: ${missing[*]}"
  apt-get update -q
  # no package may start a service of its own here (prometheus would scrape and listen): a
  # policy-rc.d that refuses every start, for the install only (Debian's convention)
  local policy=/usr/sbin/policy-rc.d ours=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && ours=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" ||
    rc=$?
  [ "$ours" = 1 ] && rm -f "$policy"
  return $rc
}

images() {
  "$repo/.venv/bin/python" "$here/build_images.py" import
  "$repo/.venv/bin/python" "$here/build_images.py" list
}

# A failure here does not fail the set-up: the rest of the suite runs and the real-node tests skip,
# naming what is missing (e2e.cluster.real_node_missing).
step "real node: Debian packages ($PACKAGES)" apt_packages &&
  step "real node: images (operator, worker-cpu, pause) built and imported into containerd" images ||
  _log "real node: set-up step failed (named above); the real-node tests will skip"
