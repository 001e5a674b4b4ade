#!/usr/bin/env bash
# Builds the local control-plane binaries from Go modules into a cache outside the repo:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm, kueue, and for
#   the real node (skipped with RLJOB_REAL_NODE=0) kubelet, kube-proxy and coredns.
# Each tool lands in $RLJOB_CACHE/bin/<tool>-<version>/ and is reused when present.
# Usage: scripts/build_controlplane.sh            (prints the bin directory list on success)
#        scripts/build_controlplane.sh jobset     (only the JobSet controller, for bench.controllers;
#                                                  set-up and CI never build it)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/versions.env
source "$here/versions.env"
source "$here/lib.sh"

export CGO_ENABLED=0
export GOFLAGS=-mod=mod
work="$CACHE/gobuild"
mkdir -p "$work" "$CACHE/bin"

k8s_minor=$(echo "$K8S_VERSION" | cut -d. -f2)
staging_version="v0.${k8s_minor}.$(echo "$K8S_VERSION" | cut -d. -f3)"

k8s_module() {  # prints the wrapper module directory (go.mod written once)
  local mod="$work/kubernetes-$K8S_VERSION"
  mkdir -p "$mod"
  if [ ! -f "$mod/go.mod" ] || ! grep -q "^require k8s.io/kubernetes $K8S_VERSION\$" "$mod/go.mod"; then
    # k8s.io/kubernetes replaces its staging modules with local paths; mirror those replaces with the
    # published staging versions so the module builds as a dependency.
    local gomod
    gomod=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    {
      echo "module rljob.local/kubernetes-build"
      echo "go 1.24"
      echo "require k8s.io/kubernetes $K8S_VERSION"
      grep -oE '^\s*k8s\.io/[a-z0-9.-]+ => \./staging/src/k8s\.io/[a-z0-9.-]+' "$gomod" |
        awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
    } > "$mod/go.mod"
  fi
  echo "$mod"
}

k8s_ldflags() {  # version stamps so /version and `kubelet --version` are real
  local ld="-s -w"
  local commit
  commit=$(echo "$K8S_VERSION" | sha1sum | cut -c1-12)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.gitCommit=$commit -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$ld"
}

build_k8s() {  # output-dir cmd...: go build the commands into $CACHE/bin/<output-dir>
  local out="$CACHE/bin/$1"; shift
  local missing=0 cmd
  for cmd in "$@"; do [ -x "$out/$cmd" ] || missing=1; done
  [ $missing = 0 ] && return 0
  local mod
  mod=$(k8s_module)
  mkdir -p "$out.tmp"
  local pkgs=()
  for cmd in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
  (cd "$mod" && go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out.tmp/" "${pkgs[@]}")
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_coredns() {
  # A main package that links only the plugins the real node's DNS uses (the way CoreDNS documents
  # custom builds), instead of every cloud provider's SDK.
  local out="$CACHE/bin/coredns-$COREDNS_VERSION"
  [ -x "$out/coredns" ] && return 0
  local mod="$work/coredns-$COREDNS_VERSION"
  mkdir -p "$mod" "$out.tmp"
  printf 'module rljob.local/coredns-build\ngo 1.25.0\nrequire github.com/coredns/coredns %s\n' "$COREDNS_VERSION" > "$mod/go.mod"
  cat > "$mod/main.go" <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"ready", "log", "errors", "health", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
  (cd "$mod" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$out.tmp/coredns" .)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_etcd() {
  local out="$CACHE/bin/etcd-$ETCD_VERSION"
  [ -x "$out/etcd" ] && return 0
  local mod="$work/etcd-$ETCD_VERSION"
  mkdir -p "$mod" "$out.tmp"
  # etcd's own go.mod replaces sibling modules with local paths; a wrapper module resolves them
  # at the same published version instead.
  printf 'module rljob.local/etcd-build\ngo 1.24\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > "$mod/go.mod"
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_go_install() {  # name module-path version
  local name=$1 pkg=$2 version=$3
  local out="$CACHE/bin/$name-$version"
  [ -x "$out/$name" ] && return 0
  mkdir -p "$out.tmp"
  (cd "$work" && GOFLAGS= GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w" "$pkg@$version")
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_go_kueue() {
  # The Kueue controller manager (cmd/kueue). Its go.mod has no replace directives, so it builds as a
  # plain `go install`; the version package gets the tag so `kueue --version`-style logs are honest.
  local out="$CACHE/bin/kueue-$KUEUE_VERSION"
  [ -x "$out/kueue" ] && [ -f "$out/webhooks.yaml" ] && return 0
  mkdir -p "$out.tmp"
  local ld="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  ld="$ld -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01T00:00:00Z"
  (cd "$work" && GOFLAGS= GOBIN="$out.tmp" go install -trimpath -ldflags "$ld" \
    "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION")
  # The CRDs and webhook registrations ship in the module source; keep a copy next to the binary so
  # the fixture (e2e/kueue.py) needs no module cache.
  local src
  src=$(cd "$work" && GOFLAGS= go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$out.tmp/crds"
  cp "$src"/config/components/crd/bases/*.yaml "$out.tmp/crds/"
  cp "$src"/config/components/webhook/manifests.yaml "$out.tmp/webhooks.yaml"
  chmod -R u+w "$out.tmp"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_go_jobset() {
  # The JobSet controller manager (the module's root package main). Its go.mod has no replace
  # directives; v0.10.1 is the newest release built against k8s.io v0.34 (the pinned K8S_VERSION's
  # libraries); v0.11 needs v0.35, v0.12 v0.36. Only bench/controllers.py asks for it.
  local out="$CACHE/bin/jobset-$JOBSET_VERSION"
  [ -x "$out/jobset" ] && [ -d "$out/crds" ] && return 0
  local mod="$work/jobset-$JOBSET_VERSION"
  mkdir -p "$mod" "$out.tmp"
  # a wrapper module, as for etcd: `go install ...@version` also asks the proxy for the module's
  # version list (deprecation check), which the proxy here refuses for sigs.k8s.io/jobset
  printf 'module rljob.local/jobset-build\ngo 1.24\nrequire sigs.k8s.io/jobset %s\n' "$JOBSET_VERSION" > "$mod/go.mod"
  local ld="-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET_VERSION"
  (cd "$mod" && go build -trimpath -ldflags "$ld" -o "$out.tmp/jobset" sigs.k8s.io/jobset)
  local src
  src=$(cd "$mod" && go list -m -json sigs.k8s.io/jobset |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$out.tmp/crds"
  cp "$src"/config/components/crd/bases/*.yaml "$out.tmp/crds/"
  chmod -R u+w "$out.tmp"
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_go_celcost() {
  # tools/celcost: reports the kube-apiserver's static CEL cost estimates for a CRD's
  # x-kubernetes-validations rules (it links the apiserver's own validation code). Keyed by the tool's
  # sources and the Go toolchain, so an edited tool rebuilds; prints the binary's path on stdout.
  # Only e2e/celcost.py asks for it (tests/operator/test_cel_cost.py, bench); set-up never builds it.
  local src="$here/../tools/celcost"
  local pinned
  pinned=$(awk '$1 == "k8s.io/apiextensions-apiserver" {print $2}' "$src/go.mod")
  if [ "$pinned" != "$staging_version" ]; then
    echo "tools/celcost/go.mod requires k8s.io/apiextensions-apiserver $pinned, but K8S_VERSION=$K8S_VERSION" \
      "needs $staging_version: update the k8s.io requirements there (go get ...@$staging_version && go mod tidy)" >&2
    return 1
  fi
  local key
  key=$( (cd "$src" && find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) | LC_ALL=C sort |
    xargs sha256sum; go version) | sha256sum | cut -c1-16)
  local out="$CACHE/bin/celcost-$key"
  if [ ! -x "$out/celcost" ]; then
    # a folder per build process, so two test runs building at once do not trip over each other
    local tmp="$out.tmp.$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    # -mod=readonly: the committed go.sum is the truth; the build never rewrites files in the repo
    GOFLAGS="-mod=readonly -buildvcs=false" go build -C "$src" -trimpath -ldflags "-s -w" -o "$tmp/celcost" . >&2
    mv -T "$tmp" "$out" 2>/dev/null || rm -rf "$tmp"  # another process finished first: keep its build
  fi
  echo "$out/celcost"
}

if [ "${1:-}" = jobset ]; then
  step "jobset $JOBSET_VERSION (controller manager + CRD)" build_go_jobset
  exit 0
fi
if [ "${1:-}" = celcost ]; then
  # no step(): its log would swallow the path this prints; the build's own output goes to stderr
  build_go_celcost
  exit 0
fi

step "etcd $ETCD_VERSION" build_etcd
step "kwok $KWOK_VERSION" build_go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
step "helm $HELM_VERSION" build_go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
step "kubernetes $K8S_VERSION (apiserver, controller-manager, scheduler, kubectl)" \
  build_k8s "kubernetes-$K8S_VERSION" kube-apiserver kube-controller-manager kube-scheduler kubectl
if [ "${RLJOB_REAL_NODE:-1}" != 0 ]; then
  # the real node's binaries, in their own folders so the control-plane build above stays cached
  # (a failure does not fail the set-up: the real-node tests skip and name what is missing)
  step "kubelet + kube-proxy $K8S_VERSION" build_k8s "kubenode-$K8S_VERSION" kubelet kube-proxy ||
    _log "real node: kubelet/kube-proxy build failed; the real-node tests will skip"
  step "coredns $COREDNS_VERSION" build_coredns ||
    _log "real node: coredns build failed; the real-node tests will skip"
fi
step "kueue $KUEUE_VERSION (controller manager + CRDs)" build_go_kueue
