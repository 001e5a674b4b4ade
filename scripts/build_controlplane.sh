#!/usr/bin/env bash
# Builds the local control-plane binaries from Go modules into a cache outside the repo:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm, kueue.
# Each tool lands in $RLJOB_CACHE/bin/<tool>-<version>/ and is reused when present.
# Usage: scripts/build_controlplane.sh            (prints the bin directory list on success)
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

build_kubernetes() {
  local out="$CACHE/bin/kubernetes-$K8S_VERSION"
  [ -x "$out/kube-apiserver" ] && [ -x "$out/kubectl" ] && return 0
  local mod="$work/kubernetes-$K8S_VERSION"
  mkdir -p "$mod"
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
  local ld="-s -w"
  local commit
  commit=$(echo "$K8S_VERSION" | sha1sum | cut -c1-12)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.gitCommit=$commit -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  mkdir -p "$out.tmp"
  (cd "$mod" && go build -trimpath -ldflags "$ld" -o "$out.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl)
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

step "etcd $ETCD_VERSION" build_etcd
step "kwok $KWOK_VERSION" build_go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
step "helm $HELM_VERSION" build_go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
step "kubernetes $K8S_VERSION (apiserver, controller-manager, scheduler, kubectl)" build_kubernetes
step "kueue $KUEUE_VERSION (controller manager + CRDs)" build_go_kueue
