#!/usr/bin/env bash
# Make the Containerfile's base image here, where no registry is reachable: a Debian bookworm
# minbase (debootstrap from the Debian mirror), slimmed as the official debian:bookworm-slim is
# (no docs but the copyrights, no man pages, no locales, no apt caches), imported with
# `podman import` under the base's public name, so the Containerfile builds unchanged. A machine
# with a registry needs none of this: `podman build` pulls the public base instead.
#
#   deploy/image/base.sh [TAG]     # default docker.io/library/debian:bookworm-slim; a no-op if present
#
# Needs root (debootstrap), podman and debootstrap (.ci/run installs both). MIRROR overrides the mirror.
set -euo pipefail
tag="${1:-docker.io/library/debian:bookworm-slim}"
mirror="${MIRROR:-http://deb.debian.org/debian}"
if podman image exists "$tag"; then
  echo "image: base $tag present"
  exit 0
fi
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "deploy/image/base.sh: '$tool' is missing (apt-get install $tool)" >&2; exit 1; }
done
work="$(mktemp -d "${TMPDIR:-/tmp}/sysdra-base.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
start=$(date +%s)
echo "image: debootstrap --variant=minbase bookworm from $mirror ..."
mkdir -p "$rootfs/etc/dpkg/dpkg.cfg.d"
# the slim image's dpkg filter, in place before the first package is unpacked
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
CFG
debootstrap --variant=minbase --components=main bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
  { tail -20 "$work/debootstrap.log" >&2; exit 1; }
cat > "$rootfs/etc/apt/sources.list" <<SRC
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SRC
# what the filter could not stop (debootstrap's first unpack runs without it) and apt's caches
find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete 2>/dev/null || true
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$rootfs"/usr/share/{man,info,groff,lintian,linda}/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/log/* "$rootfs"/tmp/*
find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} + 2>/dev/null || true
tar --numeric-owner --xattrs -C "$rootfs" -c . |
  podman import --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$tag" >/dev/null
echo "image: base $tag made in $(( $(date +%s) - start ))s ($(podman image inspect --format '{{.Size}}' "$tag") bytes)"
