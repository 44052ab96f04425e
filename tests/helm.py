"""The chart (deploy/helm/sysdra) through the real helm (tests/peers/helm, built from its Go module):
render it, and write deploy/*.yaml, the plain manifests, from its default values.

    python -m tests.helm manifests          # make manifests: rewrite deploy/<template>.yaml
    python -m tests.helm manifests --check  # exit 1 when one is stale (tests/test_helm.py asks too)

deploy/'s manifests are the chart's output, never edited by hand: the test of staleness fails
until `make manifests` has been run after a change to the chart."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from tests.conftest import REPO
from tests.controlplane import peer

CHART = os.path.join(REPO, "deploy", "helm", "sysdra")
KUBE_VERSION = "v1.37.2"  # the control plane's (tests/peers/go.mod)
RELEASE, NAMESPACE = "sysdra", "sysdra"
# the templates that deploy/ holds as plain manifests, rendered with the default values (and the namespace)
MANIFESTS = ("namespace", "resourcequota", "rbac", "admission-policy", "deviceclasses", "configmap", "daemonset")
HEADER = ("# Generated from deploy/helm/sysdra (helm template, default values, namespace.create=true) by `make manifests`:\n"
          "# edit the chart, never this file. `helm install` is the way to install (docs/install.md).\n")  # fmt: skip
_SOURCE = re.compile(r"^# Source: [^/]+/templates/(?P<name>[^\n]+)\.yaml\n", re.M)


def helm(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """The helm peer with ``args``; its caches and config in a throwaway place unless ``env`` says."""
    environ = {"HELM_CACHE_HOME": "/tmp/sysdra-helm/cache", "HELM_CONFIG_HOME": "/tmp/sysdra-helm/config",
               "HELM_DATA_HOME": "/tmp/sysdra-helm/data", **os.environ, **(env or {})}  # fmt: skip
    return subprocess.run([peer("helm"), *args], capture_output=True, text=True, check=check, env=environ)


def render(*values_files: str, sets: tuple[str, ...] = (), release: str = RELEASE, namespace: str = NAMESPACE,
           kube_version: str = KUBE_VERSION) -> str:
    """``helm template`` of the chart for a cluster of ``kube_version``: the release's objects as one YAML stream."""
    args = ["template", release, CHART, "--namespace", namespace, "--kube-version", kube_version]
    for path in values_files:
        args += ["--values", path]
    for s in sets:
        args += ["--set", s]
    return helm(*args).stdout


def by_template(stream: str) -> dict[str, str]:
    """template name -> its documents (``# Source:`` lines dropped), from ``helm template``'s output."""
    out: dict[str, list[str]] = {}
    for doc in stream.split("\n---\n"):
        doc = doc.removeprefix("---\n")
        match = _SOURCE.search(doc)
        if match and doc.strip():
            out.setdefault(match["name"], []).append(_SOURCE.sub("", doc).strip("\n") + "\n")
    return {name: "---\n".join(docs) for name, docs in out.items()}


def manifests() -> dict[str, str]:
    """deploy/<name>.yaml -> its content, as `make manifests` writes them."""
    rendered = by_template(render(sets=("namespace.create=true",)))
    missing = [name for name in MANIFESTS if name not in rendered]
    if missing:
        raise RuntimeError(f"the chart's default values render no {', '.join(missing)}")
    return {os.path.join(REPO, "deploy", f"{name}.yaml"): HEADER + rendered[name] for name in MANIFESTS}


def stale() -> list[str]:
    """deploy/ files that differ from the chart's output."""
    out = []
    for path, text in manifests().items():
        try:
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    continue
        except FileNotFoundError:
            pass
        out.append(os.path.relpath(path, REPO))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helm")
    parser.add_argument("command", choices=["manifests"])
    parser.add_argument("--check", action="store_true", help="only say which deploy/ files are stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"{name} is stale: run `make manifests`")
        return 1 if names else 0
    for path, text in manifests().items():
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        print(f"wrote {os.path.relpath(path, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
