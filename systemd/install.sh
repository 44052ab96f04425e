#!/bin/sh
# Install the sysdra systemd unit, tmpfiles.d entry and default config.
#
#   systemd/install.sh                      # onto this host (as root)
#   DESTDIR=/tmp/stage systemd/install.sh   # into a staging root (packaging, tests)
#
# Variables: DESTDIR (staging root, default none), PREFIX (default /usr/local),
# SYSDRA_BIN (the installed `sysdra` executable, default $PREFIX/bin/sysdra; for a
# virtualenv install e.g. /opt/sysdra/bin/sysdra), UNITDIR (default /etc/systemd/system),
# TMPFILESDIR (default /etc/tmpfiles.d), CONFDIR (default /etc/sysdra), SYSDRA_MPS (1: also the
# drop-in sysdra.service.d/mps.conf a node that runs CUDA MPS daemons needs, docs/sharing.md),
# SYSDRA_NRI (1: also sysdra.service.d/nri.conf, for moving claimed NICs' netdevs into their pods,
# docs/networking.md), SYSDRA_SYSFS (1: also sysdra.service.d/sysfs.conf, /sys writable for VFIO
# binding and partition mode switches, docs/vfio.md).
# An existing config.yaml is never overwritten; the new example goes to config.yaml.example.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
DESTDIR=${DESTDIR:-}
PREFIX=${PREFIX:-/usr/local}
SYSDRA_BIN=${SYSDRA_BIN:-$PREFIX/bin/sysdra}
UNITDIR=${UNITDIR:-/etc/systemd/system}
TMPFILESDIR=${TMPFILESDIR:-/etc/tmpfiles.d}
CONFDIR=${CONFDIR:-/etc/sysdra}
DOCDIR=${DOCDIR:-$PREFIX/share/doc/sysdra}

case "$SYSDRA_BIN" in
  /*) ;;
  *) echo "install.sh: SYSDRA_BIN must be an absolute path, got '$SYSDRA_BIN'" >&2; exit 2 ;;
esac
if [ -z "$DESTDIR" ] && [ ! -x "$SYSDRA_BIN" ]; then
  echo "install.sh: $SYSDRA_BIN is not executable; install sysdra first (pip install .) or set SYSDRA_BIN" >&2
  exit 1
fi

install -d -m 0755 "$DESTDIR$UNITDIR" "$DESTDIR$TMPFILESDIR" "$DESTDIR$CONFDIR" "$DESTDIR$DOCDIR"
# The unit names /usr/local/bin/sysdra; point it at the real executable.
sed "s|^ExecStart=/usr/local/bin/sysdra |ExecStart=$SYSDRA_BIN |" "$here/sysdra.service" > "$DESTDIR$UNITDIR/sysdra.service.tmp"
chmod 0644 "$DESTDIR$UNITDIR/sysdra.service.tmp"
mv "$DESTDIR$UNITDIR/sysdra.service.tmp" "$DESTDIR$UNITDIR/sysdra.service"
install -m 0644 "$here/sysdra.tmpfiles.conf" "$DESTDIR$TMPFILESDIR/sysdra.conf"
if [ "${SYSDRA_MPS:-0}" = 1 ]; then
  install -d -m 0755 "$DESTDIR$UNITDIR/sysdra.service.d"
  install -m 0644 "$here/sysdra-mps.conf" "$DESTDIR$UNITDIR/sysdra.service.d/mps.conf"
  echo "installed $DESTDIR$UNITDIR/sysdra.service.d/mps.conf (CUDA MPS: CAP_SYS_ADMIN, no file-system sandbox)"
fi
if [ "${SYSDRA_SYSFS:-0}" = 1 ]; then
  install -d -m 0755 "$DESTDIR$UNITDIR/sysdra.service.d"
  install -m 0644 "$here/sysdra-sysfs.conf" "$DESTDIR$UNITDIR/sysdra.service.d/sysfs.conf"
  echo "installed $DESTDIR$UNITDIR/sysdra.service.d/sysfs.conf (VFIO, partition modes: /sys writable)"
fi
if [ "${SYSDRA_NRI:-0}" = 1 ]; then
  install -d -m 0755 "$DESTDIR$UNITDIR/sysdra.service.d"
  install -m 0644 "$here/sysdra-nri.conf" "$DESTDIR$UNITDIR/sysdra.service.d/nri.conf"
  echo "installed $DESTDIR$UNITDIR/sysdra.service.d/nri.conf (netdev moves: CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_SYS_PTRACE)"
fi
if [ -e "$DESTDIR$CONFDIR/config.yaml" ]; then
  install -m 0644 "$here/config.yaml" "$DESTDIR$CONFDIR/config.yaml.example"
  echo "kept existing $DESTDIR$CONFDIR/config.yaml; new example in config.yaml.example"
else
  install -m 0644 "$here/config.yaml" "$DESTDIR$CONFDIR/config.yaml"
fi
if [ -f "$here/../docs/operations.md" ]; then
  install -m 0644 "$here/../docs/operations.md" "$DESTDIR$DOCDIR/operations.md"
fi

echo "installed $DESTDIR$UNITDIR/sysdra.service (ExecStart=$SYSDRA_BIN), $DESTDIR$TMPFILESDIR/sysdra.conf, $DESTDIR$CONFDIR/config.yaml"
if [ "${SYSDRA_MPS:-0}${SYSDRA_NRI:-0}${SYSDRA_SYSFS:-0}" != 111 ]; then
  echo "drop-ins: SYSDRA_NRI=1 where claimed NICs move into pods, SYSDRA_MPS=1 for shared NVIDIA GPUs," \
    "SYSDRA_SYSFS=1 for VFIO and GPU partitions (docs/operations.md)"
fi
if [ -z "$DESTDIR" ] && [ "$(id -u)" = 0 ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  systemd-tmpfiles --create "$TMPFILESDIR/sysdra.conf"
  systemctl daemon-reload
  echo "next: put a kubeconfig in $CONFDIR/kubeconfig (mode 0600; tokenFile: a token bound to this node, docs/operations.md \"Credentials\"), then: systemctl enable --now sysdra"
fi
