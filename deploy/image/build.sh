#!/usr/bin/env bash
# Build the agent's image with podman from the Containerfile and save it as an OCI archive:
#
#   deploy/image/build.sh                # ghcr.io/sysdra/sysdra:<version> -> .state/image/sysdra-<version>.oci.tar
#   TAG=0.1.0-rc2 deploy/image/build.sh  # another tag (the chart's image.tag)
#
# No registry is reachable here, so the base (BASE, default debian:bookworm-slim) is made locally
# by deploy/image/base.sh when podman does not have it; elsewhere `podman build` pulls it.
# Debian's apt mirror and PyPI must be reachable from the build. Prints the time taken and the size.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
image="${IMAGE:-ghcr.io/sysdra/sysdra}:${TAG:-$version}"
base="${BASE:-docker.io/library/debian:bookworm-slim}"
out="${OUT:-$repo/.state/image}"
command -v podman >/dev/null || { echo "deploy/image/build.sh: podman is missing (apt-get install podman)" >&2; exit 1; }
podman image exists "$base" || deploy/image/base.sh "$base"
# pip inside the build trusts what pip here trusts (a TLS-inspecting proxy's CA), as a build secret
secret=()
ca="${PIP_CERT:-$(sed -n 's/^cert *= *//p' /etc/pip.conf 2>/dev/null | head -1)}"
[ -n "$ca" ] && [ -s "$ca" ] && secret=(--secret "id=pip-ca,src=$ca")
start=$(date +%s)
podman build --quiet --pull=never "${secret[@]}" --build-arg "BASE=$base" --build-arg "VERSION=$version" \
  -t "$image" -f Containerfile . >/dev/null
built=$(( $(date +%s) - start ))
mkdir -p "$out"
archive="$out/sysdra-${TAG:-$version}.oci.tar"
rm -f "$archive"
podman save --quiet --format oci-archive -o "$archive" "$image"
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "image: $image built in ${built}s, $(( size / 1000000 )) MB; saved to ${archive#"$repo/"}"
