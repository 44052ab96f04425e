#!/bin/sh
# The agent's dependencies as wheels for the GPU machine's Python (docs/nvidia.md, "Checked on a
# real GPU"): that machine has no network, so they travel with the checkout in .whl/ (git-ignored;
# the device tool's `carry`). The versions are this venv's, the ones the tests passed with.
#
#   tests/hardware/wheels.sh             # wheels for CPython 3.12 (the GPU machine's) in .whl/
#   PYVER=3.11 tests/hardware/wheels.sh  # for another Python (a check of the set here)
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
py=${VENV_PYTHON:-.venv/bin/python}
out=${WHEELS:-.whl}
deps=$("$py" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" -m pip list --format=freeze --disable-pip-version-check > "$constraints"
rm -rf "$out"
echo "$deps" | tr '\n' '\0' | xargs -0 "$py" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version "${PYVER:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -c "$constraints" -d "$out"
echo "$(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1), in $out"
