"""``sysdra doctor`` checks of the files the agent wrote: CDI specs (schema, structure, the
runtime's minimum version), KEP-5304 metadata files and the checkpoint. Read-only."""

from __future__ import annotations

import json
import os
import stat
import time

import yaml

import cdi
from agent.fsutil import read_bounded
from agent.tools.findings import Finding, ok

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(cdi.__file__)), "schema")


# --- CDI specs --------------------------------------------------------------------------------
def _schema_validator():
    """A jsonschema validator for the vendored CDI schema, or None without jsonschema."""
    try:
        import jsonschema
        from referencing import Registry, Resource
    except ImportError:
        return None
    try:
        with open(os.path.join(SCHEMA_DIR, "schema.json"), encoding="utf-8") as f:
            schema = json.load(f)
        with open(os.path.join(SCHEMA_DIR, "defs.json"), encoding="utf-8") as f:
            defs = json.load(f)
    except OSError:  # an install without the package data: structural checks only
        return None
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=_draft7()))
    return jsonschema.Draft7Validator(schema, registry=registry)


def _draft7():
    from referencing.jsonschema import DRAFT7

    return DRAFT7


def _structural_errors(spec: object) -> list[str]:
    """The schema's required shape, for machines without jsonschema."""
    if not isinstance(spec, dict):
        return ["top level is not an object"]
    errors = [f"missing required field {k!r}" for k in ("cdiVersion", "kind", "devices") if k not in spec]
    devices = spec.get("devices")
    if "devices" in spec and not isinstance(devices, list):
        errors.append("devices is not a list")
    for i, d in enumerate(devices if isinstance(devices, list) else []):
        if not isinstance(d, dict) or "name" not in d or "containerEdits" not in d:
            errors.append(f"devices[{i}] needs name and containerEdits")
    return errors


MAX_SPEC_BYTES = 4 << 20  # as the agent's own reader of another tool's specs (prepare/nvidia.py)


def _load_spec(path: str) -> dict:
    text = read_bounded(path, MAX_SPEC_BYTES).decode()  # (a FIFO there: refused, never waited on)
    return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)


def _version_key(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.removeprefix("v").split("."))
    except ValueError:
        return ()


def check_cdi_spec(path: str, validator=None) -> tuple[list[Finding], dict | None]:
    """Parse, schema, runtime strictness, minimum version; returns findings and the spec."""
    check = f"cdi:{path}"
    try:
        spec = _load_spec(path)
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as err:  # (another tool's file: nested too deep too)
        why = "nested too deep" if isinstance(err, RecursionError) else str(err).splitlines()[0]
        return [Finding(check, "fail", f"does not parse: {why}",
                        "the runtime ignores the file (or fails every container using it): fix or remove it")], None
    if validator is not None:
        errors = [f"{'/'.join(map(str, e.absolute_path)) or 'spec'}: {e.message}" for e in validator.iter_errors(spec)]
    else:
        errors = _structural_errors(spec)
    if errors:
        return [Finding(check, "fail", "violates the CDI schema: " + "; ".join(errors[:3]), "regenerate the spec with its tool")], None
    found: list[Finding] = []
    try:
        from cdi.spec import SpecError, minimum_version, validate
    except ImportError:
        return [Finding(check, "warn", "parses and matches the schema; minimum-version rule not available in this build")], spec
    try:
        validate(spec)
    except SpecError as err:
        msg = str(err)
        fix = ("lower cdiVersion to what the content needs (older runtimes reject newer versions) or remove the newer fields"
               if "below" not in msg else "raise cdiVersion: the content uses newer fields")
        return [Finding(check, "fail", f"a container runtime rejects it: {msg}", fix)], spec
    need, have = minimum_version(spec), str(spec.get("cdiVersion")).removeprefix("v")
    if _version_key(have) > _version_key(need):
        found.append(Finding(check, "warn", f"cdiVersion {have} but the content needs only {need}",
                             f"write cdiVersion {need}: runtimes older than {have} refuse the file"))
    else:
        found.append(ok(check, f"valid, cdiVersion {have}, {len(spec.get('devices') or [])} devices"))
    return found, spec


def check_cdi_dirs(dirs: list[str]) -> list[Finding]:
    validator = _schema_validator()
    found: list[Finding] = []
    if validator is None:
        found.append(Finding("cdi", "warn", "jsonschema or the vendored schema (cdi/schema) missing: structural checks only", "pip install jsonschema"))
    seen: dict[str, str] = {}  # qualified device -> file that defines it
    for d in dirs:
        if not os.path.isdir(d):
            found.append(Finding("cdi", "skip" if d == "/etc/cdi" else "warn", f"{d} does not exist",
                                 "" if d == "/etc/cdi" else "systemd-tmpfiles --create /etc/tmpfiles.d/sysdra.conf"))
            continue
        names = sorted(n for n in os.listdir(d) if n.endswith((".json", ".yaml")) and not n.startswith("."))
        per_dir: list[Finding] = []
        for name in names:
            path = os.path.join(d, name)
            spec_findings, spec = check_cdi_spec(path, validator)
            per_dir.extend(spec_findings)
            for dev in (spec or {}).get("devices") or []:
                qualified = f"{spec.get('kind')}={dev.get('name')}"
                if qualified in seen:
                    per_dir.append(Finding(f"cdi:{path}", "fail", f"device {qualified} is also defined in {seen[qualified]}",
                                         "the runtime refuses conflicting devices: remove the stale file"))
                seen.setdefault(qualified, path)
                for node in (dev.get("containerEdits") or {}).get("deviceNodes") or []:
                    host = node.get("hostPath") or node.get("path")
                    if host and not os.path.exists(host):
                        per_dir.append(Finding(f"cdi:{path}", "warn", f"device {qualified}: {host} does not exist on this host",
                                             "a container using it fails to start; the device is gone or the spec is stale"))
        found.extend(group_findings(d, per_dir))
        if not names:
            found.append(ok("cdi", f"{d}: no specs"))
    return found


GROUP_OVER = 10  # more findings alike than this in one directory are reported as one


def group_findings(directory: str, findings: list[Finding]) -> list[Finding]:
    """Hundreds of prepared claims mean hundreds of spec files: report alike findings of
    one directory as one line with a count and a few example files."""
    groups: dict[tuple[str, str], list[Finding]] = {}  # findings alike: same level and same fix
    for f in findings:
        groups.setdefault((f.level, f.fix), []).append(f)
    out: list[Finding] = []
    for (level, fix), members in groups.items():
        if len(members) <= GROUP_OVER:
            out.extend(members)
            continue
        files = sorted({os.path.basename(m.check.removeprefix("cdi:")) for m in members})
        examples = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        what = "valid specs" if level == "ok" else f"specs, e.g. {members[0].message}"
        out.append(Finding(f"cdi:{directory}", level, f"{len(files)} {what} ({examples})", fix))
    return out


# --- KEP-5304 metadata files ------------------------------------------------------------------
def parse_json_stream(text: str) -> list:
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


def check_metadata(plugin_dir: str) -> list[Finding]:
    top = os.path.join(plugin_dir, "dra-device-metadata")
    if not os.path.isdir(top):
        return [Finding("metadata", "skip", f"{top} does not exist (no claims prepared with device metadata)")]
    found: list[Finding] = []
    count = 0
    for dirpath, _, files in os.walk(top):
        for name in files:
            if name != "metadata.json":
                continue
            path = os.path.join(dirpath, name)
            count += 1
            try:
                objs = parse_json_stream(read_bounded(path, 1 << 20).decode())
            except (OSError, ValueError, RecursionError) as err:
                why = "nested too deep" if isinstance(err, RecursionError) else err
                found.append(Finding(f"metadata:{path}", "fail", f"not a complete JSON stream: {why}",
                                     "the agent rewrites it on the next prepare; unprepare/prepare the claim or delete the pod"))
                continue
            bad = [o for o in objs if not (isinstance(o, dict) and o.get("kind") == "DeviceMetadata"
                                           and str(o.get("apiVersion", "")).startswith("metadata.resource.k8s.io/")
                                           and isinstance(o.get("requests"), list))]
            if not objs or bad:
                found.append(Finding(f"metadata:{path}", "fail", "empty or not DeviceMetadata objects",
                                     "remove the file; the agent writes it on prepare"))
            elif stat.S_IMODE(os.stat(path).st_mode) & 0o004 == 0:
                found.append(Finding(f"metadata:{path}", "warn", "not world-readable", f"chmod 0644 {path}"))
    if count and not found:
        found.append(ok("metadata", f"{count} metadata files are complete"))
    elif not count:
        found.append(ok("metadata", "no metadata files"))
    return found


def check_checkpoint(plugin_dir: str) -> list[Finding]:
    """The record of prepared claims loads (read-only: nothing is moved or repaired here),
    and no corrupt one was moved aside and forgotten."""
    from agent.prepare.checkpoint import STARTED, Checkpoint, CheckpointError

    path = os.path.join(plugin_dir, "checkpoint.json")
    found = _checkpoint_aside(plugin_dir)
    if not os.path.exists(path) and not os.path.exists(path + ".journal"):
        return found + [Finding("checkpoint", "skip", f"{path} does not exist (no claim prepared yet)")]
    try:
        cp = Checkpoint.load(path, move_corrupt=False)
    except CheckpointError as err:  # a newer sysdra's, or a file that cannot be read: the message says which
        fix = "make it the agent's file again" if "cannot be read" in str(err) else "run the sysdra version that wrote it"
        return found + [Finding("checkpoint", "fail", str(err), fix)]
    except (OSError, ValueError, RecursionError) as err:
        return found + [Finding("checkpoint", "fail", f"does not load: {err}",
                                "the agent's NRI plugin repairs it at the next pod event (within 10 s); without NRI, "
                                "restart the agent. Either moves the files aside, logs CHECKPOINT CORRUPT, keeps the "
                                "entries they still establish (and its last save's) and adopts the claims whose CDI "
                                "specs exist")]
    found += _checkpoint_entries(cp)
    started = [u for u, e in cp.claims.items() if e.get("state") == STARTED]
    found.append(ok("checkpoint", f"{len(cp.claims)} claims recorded ({len(started)} being prepared), "
                                  f"generation {cp.generation}, {cp.journal_records} journal records"))
    return found


def _checkpoint_aside(plugin_dir: str) -> list[Finding]:
    """A warning while corrupt checkpoints or rejected entries moved aside are still there."""
    try:
        aside = sorted(n for n in os.listdir(plugin_dir) if n.startswith("checkpoint.json")
                       and (".corrupt-" in n or ".rejected-" in n))
    except OSError:
        aside = []
    if not aside:
        return []
    stamp = aside[-1].rsplit("-", 1)[1]  # a Unix time the agent wrote; any name may be there
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(stamp))) \
        if stamp.isascii() and stamp.isdigit() and len(stamp) <= 11 else "?"
    return [Finding("checkpoint:aside", "warn",
                    f"a corrupt checkpoint or invalid entries were moved aside (last at {when}): {', '.join(aside)}",
                    f"inspect them (the agent kept what they still established and adopted the claims it found CDI specs "
                    f"for; an ERROR names claims whose netdev records are lost), then remove them from {plugin_dir}")]


def _checkpoint_entries(cp) -> list[Finding]:
    """Warnings for entries a loaded checkpoint holds but cannot use as it does the others:
    invalid ones, a newer sysdra's, adopted claims whose netdev records are lost."""
    found: list[Finding] = []
    if cp.rejected:
        found.append(Finding("checkpoint:rejected", "warn",
                             f"{len(cp.rejected)} entries are not valid records and are not used: "
                             + "; ".join(f"{str(u)[:80]}: {why}" for u, (_, why) in list(cp.rejected.items())[:3]),
                             "restart the agent: it moves them aside (checkpoint.json.rejected-<time>) and adopts "
                             "the claims whose CDI specs exist"))
    if cp.foreign:  # kept as written, held, never rewritten (agent/prepare/checkpoint_entries.py)
        found.append(Finding("checkpoint:foreign", "warn",
                             f"{len(cp.foreign)} entries were written by a newer sysdra, with fields this one does not "
                             "know: " + "; ".join(f"{u}: {f.fields}" for u, f in list(cp.foreign.items())[:3]),
                             "run the sysdra that wrote them: this one keeps them as written and their claims prepared, "
                             "but cannot redo or undo what those fields record (an unprepare here leaves it)"))
    lost = {u: e["netdevsLost"] for u, e in cp.claims.items() if e.get("netdevsLost")}
    if lost:  # recovery adopted them after a damaged checkpoint or a rejected entry (docs/networking.md)
        found.append(Finding("checkpoint:netdevs-lost", "warn",
                             f"{len(lost)} claims lost their netdev records and their pods are refused: "
                             + "; ".join(f"{u}: {why}" for u, why in list(lost.items())[:3]),
                             "find their NICs' netdevs (in a pod's namespace, or on the host under the name they had "
                             "there), then delete the pods: the kubelet unprepares the claims"))
    return found
