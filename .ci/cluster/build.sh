#!/usr/bin/env bash
# Builds the Kubernetes control plane the end-to-end tests run against, from official Go modules only (no
# downloaded binaries). Each component is cached under $WANLOOM_CLUSTER_CACHE (default ~/.cache/wanloom/cluster)
# in a folder named for its version, so a second run only checks that the binaries exist.
#   usage: .ci/cluster/build.sh   -> prints KEY=PATH lines (sourced by up.sh)
set -euo pipefail
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.8}"
JOBSET_VERSION="${JOBSET_VERSION:-v0.12.0}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
KUEUE_VERSION="${KUEUE_VERSION:-v0.17.0}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.4.2}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
CACHE="${WANLOOM_CLUSTER_CACHE:-$HOME/.cache/wanloom/cluster}"
export GOFLAGS="${GOFLAGS:--mod=mod}" CGO_ENABLED=0

log() { echo "build.sh: $*" >&2; }

# Release modules that carry replace directives (k8s.io/kubernetes, etcd) cannot be `go install`ed, and
# `go install pkg@version` also reads the module's version list, which the proxy refuses for some modules. Each
# component is therefore built inside a throwaway module that requires it:
#   throwaway DIR 'require lines' [replace args...]
throwaway() {
  local dir="$1" requires="$2"
  shift 2
  mkdir -p "$dir"
  [ -f "$dir/go.sum" ] && return 0
  printf 'module wanloom.local/build\n\ngo 1.26\n\nrequire %s\n' "$requires" > "$dir/go.mod"
  local r
  for r in "$@"; do (cd "$dir" && go mod edit -replace "$r"); done
}

# The control plane, and the real node's kubelet and kube-proxy, from one build of k8s.io/kubernetes.
K8S_COMMANDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

build_k8s() {
  local bin="$CACHE/kubernetes-$K8S_VERSION" c missing=0
  for c in "${K8S_COMMANDS[@]}"; do [ -x "$bin/$c" ] || missing=1; done
  if [ "$missing" = 1 ]; then
    local work="$CACHE/src/kubernetes-$K8S_VERSION" minor="${K8S_VERSION#v1.}"
    # k8s.io/kubernetes replaces its staging modules with local paths: pin each to the matching v0.Y.Z release,
    # reading the list from its own go.mod so a new version needs no edit here.
    local gomod replaces=()
    gomod="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
    while read -r mod; do replaces+=("$mod=$mod@v0.$minor"); done < <(
      grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' | sort -u)
    throwaway "$work" "k8s.io/kubernetes $K8S_VERSION" "${replaces[@]}"
    { printf '//go:build tools\n\npackage tools\n\nimport (\n'
      printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "${K8S_COMMANDS[@]}"
      printf ')\n'; } > "$work/tools.go"
    (cd "$work" && go mod tidy -e >/dev/null)
    local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION
      -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*}"
    mkdir -p "$bin"
    for c in "${K8S_COMMANDS[@]}"; do
      [ -x "$bin/$c" ] && continue
      log "building $c $K8S_VERSION (all five: ~15 min cold on 2 cores)"
      (cd "$work" && go build -trimpath -ldflags "$ldflags" -o "$bin/$c.tmp" "k8s.io/kubernetes/cmd/$c")
      mv "$bin/$c.tmp" "$bin/$c"
    done
  fi
  echo "KUBERNETES_BIN=$bin"
}

build_etcd() {
  local bin="$CACHE/etcd-$ETCD_VERSION"
  if [ ! -x "$bin/etcd" ]; then
    log "building etcd $ETCD_VERSION"
    local work="$CACHE/src/etcd-$ETCD_VERSION"
    throwaway "$work" "go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    # The etcd command's own module has replace directives; its entry point is etcdmain.Main.
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' > "$work/main.go"
    mkdir -p "$bin"
    (cd "$work" && go mod tidy >/dev/null && go build -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" .)
    mv "$bin/etcd.tmp" "$bin/etcd"
  fi
  echo "ETCD_BIN=$bin"
}

# A release module without replace directives: one package of it built in a throwaway module.
#   build_module DIR_NAME MODULE VERSION PACKAGE BINARY
build_module() {
  local bin="$CACHE/$1" module="$2" version="$3" package="$4" binary="$5"
  if [ ! -x "$bin/$binary" ]; then
    log "building $package $version"
    local work="$CACHE/src/$1"
    throwaway "$work" "$module $version"
    printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" > "$work/tools.go"
    mkdir -p "$bin"
    (cd "$work" && go mod tidy -e >/dev/null && go build -trimpath -ldflags "-s -w" -o "$bin/$binary.tmp" "$package") >&2
    mv "$bin/$binary.tmp" "$bin/$binary"
  fi
  echo "$bin"
}

# Where the throwaway module DIR_NAME has MODULE's source: CRDs and webhook rules ship inside the module, so the
# cluster serves the version the controller was built from.
#   module_source DIR_NAME MODULE
module_source() {
  (cd "$CACHE/src/$1" && go list -m -f '{{.Dir}}' "$2")
}

build_jobset() {
  local bin
  bin="$(build_module "jobset-$JOBSET_VERSION" sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset jobset-controller)"
  if [ ! -f "$bin/jobset-webhooks.yaml" ]; then
    local dir
    dir="$(module_source "jobset-$JOBSET_VERSION" sigs.k8s.io/jobset)"
    cp "$dir/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" "$bin/jobset-crd.yaml"
    cp "$dir/config/components/webhook/manifests.yaml" "$bin/jobset-webhooks.yaml"
  fi
  echo "JOBSET_BIN=$bin"
}

build_kwok() {
  echo "KWOK_BIN=$(build_module "kwok-$KWOK_VERSION" sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok kwok)"
}

build_kueue() {
  local bin
  bin="$(build_module "kueue-$KUEUE_VERSION" sigs.k8s.io/kueue "$KUEUE_VERSION" sigs.k8s.io/kueue/cmd/kueue kueue)"
  if [ ! -d "$bin/crds" ]; then
    local dir
    dir="$(module_source "kueue-$KUEUE_VERSION" sigs.k8s.io/kueue)"
    mkdir -p "$bin/crds.tmp"
    cp "$dir"/config/components/crd/bases/*.yaml "$bin/crds.tmp/"
    cp "$dir/config/components/webhook/manifests.yaml" "$bin/kueue-webhooks.yaml"
    mv "$bin/crds.tmp" "$bin/crds"
  fi
  echo "KUEUE_BIN=$bin"
}

# The real node's runtime: containerd, its runc shim and ctr (one module), and the pause binary every pod sandbox
# runs, compiled from the C source k8s.io/kubernetes ships (build/pause) since registry.k8s.io cannot be reached.
build_containerd() {
  local bin="$CACHE/containerd-$CONTAINERD_VERSION" c
  if [ ! -x "$bin/ctr" ]; then
    local work="$CACHE/src/containerd-$CONTAINERD_VERSION" cmd="github.com/containerd/containerd/v2/cmd"
    throwaway "$work" "github.com/containerd/containerd/v2 $CONTAINERD_VERSION"
    printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "%s/containerd"\n\t_ "%s/containerd-shim-runc-v2"\n\t_ "%s/ctr"\n)\n' \
      "$cmd" "$cmd" "$cmd" > "$work/tools.go"
    (cd "$work" && go mod tidy -e >/dev/null)
    mkdir -p "$bin"
    for c in containerd containerd-shim-runc-v2 ctr; do
      log "building $c $CONTAINERD_VERSION"
      (cd "$work" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w" -o "$bin/$c.tmp" "$cmd/$c")
      mv "$bin/$c.tmp" "$bin/$c"
    done
  fi
  echo "CONTAINERD_BIN=$bin"
}

build_pause() {
  local bin="$CACHE/kubernetes-$K8S_VERSION"
  if [ ! -x "$bin/pause" ]; then
    local src tag
    src="$(module_source "kubernetes-$K8S_VERSION" k8s.io/kubernetes)/build/pause"
    tag="$(sed -n 's/^TAG ?= //p' "$src/Makefile")"
    log "compiling pause $tag from k8s.io/kubernetes $K8S_VERSION"
    gcc -Os -Wall -static -DVERSION="v$tag" -o "$bin/pause.tmp" "$src/linux/pause.c"
    echo "$tag" > "$bin/pause.version"
    mv "$bin/pause.tmp" "$bin/pause"
  fi
}

build_coredns() {
  echo "COREDNS_BIN=$(build_module "coredns-$COREDNS_VERSION" github.com/coredns/coredns "$COREDNS_VERSION" github.com/coredns/coredns coredns)"
}

command -v go >/dev/null || { log "the Go toolchain is needed to build the control plane (go.dev/dl)"; exit 1; }
build_k8s
build_etcd
build_jobset
build_kwok
build_kueue
build_containerd
build_pause
build_coredns
