#!/usr/bin/env bash
# Build the Go test peers (tests/peers) into .peers/bin: allocator, etcd, kube-apiserver, kube-scheduler.
#
#   tests/peers/build.sh [allocator|etcd|kube-apiserver|kube-scheduler ...]   # default: all, allocator first
#   tests/peers/build.sh --gen-replace                         # print go.mod's replace block
#
# Module and build caches live in .peers/ (git-ignored) unless GOMODCACHE / GOCACHE are set, so a
# second run on the same machine does not download or compile again; a binary newer than every
# source file, go.mod and go.sum is not even relinked. PEERS_DIR moves the whole .peers folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
peers="${PEERS_DIR:-$repo/.peers}"

if ! command -v go >/dev/null 2>&1; then
  echo "tests/peers/build.sh: 'go' is not on PATH; the test peers need Go >= 1.26 (https://go.dev/dl/)" >&2
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

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(allocator etcd kube-apiserver kube-scheduler)

for t in "${targets[@]}"; do
  [ -d "$here/$t" ] || { echo "tests/peers/build.sh: unknown peer '$t'" >&2; exit 2; }
  bin="$peers/bin/$t"
  # up to date: the binary is newer than every input (go.mod, go.sum, this script, its sources) (the Go build cache makes a rebuild cheap anyway)
  if [ -x "$bin" ] && [ -z "$(find "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/$t" -newer "$bin" -print -quit)" ]; then
    echo "peers: $t up to date ($bin)"
    continue
  fi
  echo "peers: building $t ..."
  start=$(date +%s)
  # the version the server reports (/version) is the module's, as a release build stamps it
  kver="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
  minor="${kver#v1.}"; minor="${minor%%.*}"
  stamp="-X k8s.io/component-base/version.gitVersion=$kver -X k8s.io/component-base/version.gitMajor=1"
  stamp="$stamp -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$here" && go build -p "$jobs" -trimpath -ldflags="-s -w $stamp" -o "$bin.tmp" "./$t")
  mv -f "$bin.tmp" "$bin"
  echo "peers: built $t in $(( $(date +%s) - start ))s"
done
