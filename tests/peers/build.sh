#!/usr/bin/env bash
# Build the Go test peers (tests/peers) into .peers/bin: allocator, etcd, kube-apiserver,
# kube-scheduler, the real node's kube-controller-manager, kubelet and containerd (+ ctr, shim), the
# bench's floor DRA plugin (draplugin, on the upstream kubeletplugin helper), and helm (the chart's
# tests, deploy/helm/sysdra).
#
#   tests/peers/build.sh [PEER ...]        # default: all, allocator first
#   tests/peers/build.sh control-plane     # allocator etcd kube-apiserver kube-scheduler
#   tests/peers/build.sh node              # kube-controller-manager kubelet containerd ctr containerd-shim-runc-v2 draplugin
#   tests/peers/build.sh helm              # helm v3 (docs/install.md)
#   tests/peers/build.sh crds              # prometheus-operator's ServiceMonitor and PrometheusRule CRDs
#   tests/peers/build.sh --gen-replace     # print go.mod's replace block
#
# The Kubernetes peers share one module (tests/peers/go.mod); containerd v2 has a module of its
# own (tests/peers/containerd/go.mod), because its dependencies differ from k8s.io/kubernetes's;
# so has helm (tests/peers/helm/go.mod), whose client-go is not the control plane's.
#
# Module and build caches live in .peers/ (git-ignored) unless GOMODCACHE / GOCACHE are set, so a
# second run on the same machine does not download or compile again; a binary newer than every
# source file, go.mod and go.sum is not even relinked. PEERS_DIR moves the whole .peers folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
peers="${PEERS_DIR:-$repo/.peers}"

if ! command -v go >/dev/null 2>&1; then
  echo "tests/peers/build.sh: 'go' is not on PATH; the test peers need Go >= 1.26.6 (https://go.dev/dl/)" >&2
  exit 1
fi

if [ "${1:-}" = "--gen-replace" ]; then
  # k8s.io/kubernetes requires its staging modules at v0.0.0; each is published as v0.<minor>.<patch>.
  kver="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
  sver="v0.${kver#v1.}"
  mod="$(cd "$here" && go mod download -json "k8s.io/kubernetes@$kver" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')"
  echo "replace ("
  awk '/^require \(/{r=1;next} r&&/^\)/{r=0} r&&$1~/^k8s\.io\//&&$2=="v0.0.0"{print $1}' "$mod" |
    while read -r m; do printf '\t%s => %s %s\n' "$m" "$m" "$sver"; done
  echo ")"
  exit 0
fi

export GOMODCACHE="${GOMODCACHE:-$peers/gomod}"
export GOCACHE="${GOCACHE:-$peers/gocache}"
export GOFLAGS="-modcacherw -buildvcs=false -mod=readonly ${GOFLAGS:-}"
export CGO_ENABLED=0 GOTOOLCHAIN=local
jobs="${PEERS_JOBS:-2}"
mkdir -p "$peers/bin"

control_plane=(allocator etcd kube-apiserver kube-scheduler)
node=(kube-controller-manager kubelet containerd ctr containerd-shim-runc-v2 draplugin)
targets=()
for t in "$@"; do
  case "$t" in
    control-plane) targets+=("${control_plane[@]}") ;;
    node) targets+=("${node[@]}") ;;
    *) targets+=("$t") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${control_plane[@]}" "${node[@]}" helm crds)

# The CRDs of the chart's ServiceMonitor and PrometheusRule, from prometheus-operator's module (its
# example/ holds the generated CRDs), into .peers/crds: tests/test_helm.py validates the chart's objects
# of those kinds on the real API server against them. The module's hash is checked (and the sumdb's).
PROM_OPERATOR=v0.85.0
PROM_OPERATOR_SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
crds() {
  local out="$peers/crds" json dir
  if [ "$(cat "$out/.version" 2>/dev/null)" = "$PROM_OPERATOR" ]; then
    echo "peers: crds up to date ($out)"
    return
  fi
  json="$(cd "$peers" && GOFLAGS=-modcacherw go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR")"
  if ! grep -q "\"Sum\": \"$PROM_OPERATOR_SUM\"" <<<"$json"; then
    echo "tests/peers/build.sh: prometheus-operator $PROM_OPERATOR does not have the hash $PROM_OPERATOR_SUM" >&2
    exit 1
  fi
  dir="$(sed -n 's/.*"Dir": "\(.*\)",/\1/p' <<<"$json")"
  mkdir -p "$out"
  for kind in servicemonitors prometheusrules; do
    cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$out/"
  done
  echo "$PROM_OPERATOR" > "$out/.version"
  echo "peers: crds of prometheus-operator $PROM_OPERATOR in $out"
}

for t in "${targets[@]}"; do
  tags=""
  case "$t" in
    crds)
      crds
      continue ;;
    containerd|ctr|containerd-shim-runc-v2)
      # CGO_ENABLED=0 leaves out the btrfs snapshotter's cgo; no_btrfs says so to the build
      mod="$here/containerd"; pkg="github.com/containerd/containerd/v2/cmd/$t"; tags="-tags=no_btrfs" ;;
    helm)
      mod="$here/helm"; pkg="helm.sh/helm/v3/cmd/helm" ;;
    *)
      [ -d "$here/$t" ] && [ "$t" != containerd ] || { echo "tests/peers/build.sh: unknown peer '$t'" >&2; exit 2; }
      mod="$here"; pkg="./$t" ;;
  esac
  bin="$peers/bin/$t"
  # up to date: the binary is newer than every input (go.mod, go.sum, this script, its sources) (the Go build cache makes a rebuild cheap anyway)
  sources=("$mod/go.mod" "$mod/go.sum" "$here/build.sh")
  [ "$mod" = "$here" ] && sources+=("$here/$t")
  if [ -x "$bin" ] && [ -z "$(find "${sources[@]}" -newer "$bin" -print -quit)" ]; then
    echo "peers: $t up to date ($bin)"
    continue
  fi
  echo "peers: building $t ..."
  start=$(date +%s)
  if [ "$mod" = "$here" ]; then
    # the version the server reports (/version) is the module's, as a release build stamps it
    kver="$(cd "$mod" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
    minor="${kver#v1.}"; minor="${minor%%.*}"
    stamp="-X k8s.io/component-base/version.gitVersion=$kver -X k8s.io/component-base/version.gitMajor=1"
    stamp="$stamp -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  elif [ "$t" = helm ]; then
    hver="$(cd "$mod" && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
    stamp="-X helm.sh/helm/v3/internal/version.version=$hver"
  else
    cver="$(cd "$mod" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
    stamp="-X github.com/containerd/containerd/v2/version.Version=${cver#v}"
  fi
  (cd "$mod" && go build -p "$jobs" $tags -trimpath -ldflags="-s -w $stamp" -o "$bin.tmp" "$pkg")
  mv -f "$bin.tmp" "$bin"
  echo "peers: built $t in $(( $(date +%s) - start ))s"
done
