"""Regenerate the committed gRPC stubs: ``make protos`` (``python -m agent.protos.generate``).

Runs grpc_tools.protoc on every ``*.proto`` here and rewrites the generated
top-level imports (``import dra_v1_pb2``) to package-relative ones so the stubs
work as ``agent.protos.dra_v1_pb2``. tests/test_protos.py regenerates into a temp
dir and fails when the committed files differ.
"""

from __future__ import annotations

import glob
import os
import re
import sys

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))


def proto_files() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(PROTO_DIR, "*.proto")))


def _fix_imports(path: str, modules: set[str]) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for mod in modules:
        text = re.sub(rf"^import {mod} as ", f"from . import {mod} as ", text, flags=re.M)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def generate(out_dir: str = PROTO_DIR) -> list[str]:
    """Write ``<name>_pb2.py`` and ``<name>_pb2_grpc.py`` for each proto; return their paths."""
    from grpc_tools import protoc  # test-only dependency: imported here, not at module load

    protos = proto_files()
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    modules = {p[:-len(".proto")] + "_pb2" for p in protos}
    out = []
    for p in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            path = os.path.join(out_dir, p[:-len(".proto")] + suffix)
            _fix_imports(path, modules)
            out.append(path)
    return out


def main() -> int:
    for path in generate():
        print(os.path.relpath(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
