#!/bin/sh
# The real-GPU check in one call on the lent GPU machine, from the repository root, with the wheels
# of tests/hardware/wheels.sh carried in .whl/ (docs/nvidia.md, "Checked on a real GPU"): they go
# into a site directory of their own, never the machine's, and the check writes its files to $OUT.
set -eu
site=$(mktemp -d /tmp/sysdra-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD"
python3 -c 'import agent.cli.main, agent.service.daemon, agent.kubeletplugin.claims'  # the set is complete
python3 -m tests.hardware.nvidia_check --driver-root "${DRIVER_ROOT:-/usr/local/nvidia}" --out "${OUT:?the output dir}"
