"""``sysdra record``: copy what discovery reads from /sys, /proc and /dev into a fixture
tree that ``--root OUT`` replays, for bug reports and new test profiles.

What gets recorded is learnt, not listed: a discovery scan runs with its file
operations traced (as bench/bench_scan.py does) and exactly the paths it touched are
reproduced, then the recording is scanned the same way and anything the replay asks
for that the first pass missed is added, until nothing is missing.

- symlinks stay symlinks (relative targets verbatim; absolute ones are made relative
  so the replay stays inside OUT), directories stay directories;
- file contents only for whitelisted text: regular files of at most 4 KiB that decode
  as UTF-8 without NULs, never ``config``, ``rom``, ``resource*``, ``vpd`` (binary or
  sensitive); other files that discovery saw in a listing become empty placeholders;
- device nodes become empty placeholder files; their type and major:minor go to
  ``OUT/.sysdra-record/devnodes.json``, and the ``/sys/dev/{char,block}/MAJ:MIN/dev``
  attribute and ``/proc/devices`` that discovery already falls back to are recorded;
- ``--redact`` replaces MAC addresses, InfiniBand GUIDs, UUIDs and serial numbers with
  fakes, the same fake for the same value throughout the recording.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field

from agent.tools.fstrace import LISTINGS, plain_op, traced_scan

MAX_TEXT = 4096
DENY = re.compile(r"^(config|rom|resource\d*(_wc)?|vpd|remove|rescan|reset|new_id|remove_id|bind|unbind)$")
SIDE_DIR = ".sysdra-record"


# --- redaction ---------------------------------------------------------------------------------
_HEX = "0123456789abcdef"
_PATTERNS = (
    # GPU UUIDs and plain UUIDs
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    # InfiniBand hardware addresses (20 bytes) before Ethernet MACs (6 bytes)
    ("mac", re.compile(r"\b(?:[0-9a-fA-F]{2}:){19}[0-9a-fA-F]{2}\b")),
    ("mac", re.compile(r"\b(?:[0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}\b")),
    # node / port / system image GUIDs: 1234:5678:9abc:def0
    ("guid", re.compile(r"\b[0-9a-fA-F]{4}:[0-9a-fA-F]{4}:[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\b")),
    # "Serial Number: XYZ" lines (nvidia /proc information, lspci-like dumps)
    ("serial", re.compile(r"(?im)(?<=serial number:)[ \t]*\S[^\n]*")),
)
_SERIAL_FILES = re.compile(r"(^|_)serial(_number|_num)?$|^(board|product)_serial$|^sn$")


class Redactor:
    """Keyed, consistent replacement: one secret per recording, the same value -> the same fake."""

    def __init__(self, key: bytes | None = None):
        self.key = key if key is not None else secrets.token_bytes(16)
        self.replaced: dict[str, str] = {}

    def _digest(self, value: str) -> str:
        return hashlib.sha256(self.key + value.lower().encode()).hexdigest()

    def fake(self, kind: str, value: str) -> str:
        if set(value.lower()) <= set("0:-f") and (set(value.lower()) <= set("0:-") or set(value.lower()) <= set("f:-")):
            return value  # broadcast / all-zero addresses carry nothing
        if value in self.replaced:
            return self.replaced[value]
        h = iter(self._digest(value) * 4)
        out = []
        for i, c in enumerate(value):
            if c in "0123456789abcdefABCDEF" and kind != "serial":
                out.append(next(h))
            elif kind == "serial" and c.isalnum():
                out.append(next(h).upper())
            else:
                out.append(c)
        fake = "".join(out)
        if kind == "mac" and len(value) == 17:
            fake = "02" + fake[2:]  # locally administered: cannot collide with a real vendor
        if kind == "uuid" or value.islower():
            fake = fake.lower()
        self.replaced[value] = fake
        return fake

    def text(self, name: str, content: str) -> str:
        if _SERIAL_FILES.search(name) and content.strip():
            return self.fake("serial", content.strip()) + ("\n" if content.endswith("\n") else "")
        for kind, pattern in _PATTERNS:
            content = pattern.sub(lambda m, k=kind: self._serial_sub(m) if k == "serial" else self.fake(k, m.group(0)), content)
        return content

    def _serial_sub(self, m: re.Match) -> str:
        raw = m.group(0)
        lead = raw[: len(raw) - len(raw.lstrip())]
        return lead + self.fake("serial", raw.strip())


# --- recording ----------------------------------------------------------------------------------
@dataclass
class Recording:
    root: str
    out: str
    redactor: Redactor | None = None
    files: int = 0
    placeholders: int = 0
    links: int = 0
    dirs: int = 0
    skipped: list[str] = field(default_factory=list)  # (path: reason) of files not copied
    devnodes: dict[str, dict] = field(default_factory=dict)
    copied: set[str] = field(default_factory=set)  # files whose content was decided

    def src(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def dst(self, rel: str) -> str:
        return os.path.join(self.out, rel)


def _rel_parts(root: str, path: str) -> list[str] | None:
    rel = os.path.relpath(os.path.normpath(path), root)
    if rel == ".":
        return []
    if rel.startswith(".."):
        return None
    return rel.split(os.sep)


def _materialize(rec: Recording, parts: list[str], content: bool, depth: int = 0) -> list[str] | None:
    """Reproduce the path ``parts`` (relative to the root) in OUT, following symlinks like
    the kernel does; returns the resolved (symlink-free) parts, None if it does not exist."""
    if depth > 40:
        return None  # ELOOP: leave it to the replay to fail the same way
    cur: list[str] = []
    for i, name in enumerate(parts):
        last = i == len(parts) - 1
        if name == "..":
            cur = cur[:-1]
            continue
        if name in (".", ""):
            continue
        rel = os.path.join(*cur, name)
        try:
            st = os.lstat(rec.src(rel))
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(rec.src(rel))
            _make_link(rec, rel, target)
            if os.path.isabs(target):
                resolved = _rel_parts(rec.root, target)
                if resolved is None:
                    return None
            else:
                resolved = os.path.normpath(os.path.join(*cur, target) if cur else target).split(os.sep)
            if resolved and resolved[0] == "..":
                return None  # escapes the root
            got = _materialize(rec, [p for p in resolved if p not in ("", ".")], content or not last, depth + 1)
            if got is None:
                return None
            cur = got
        elif stat.S_ISDIR(st.st_mode):
            _make_dir(rec, rel, st)
            cur.append(name)
        else:
            _make_leaf(rec, rel, st, content and last)
            cur.append(name)
    return cur


def _make_dir(rec: Recording, rel: str, st: os.stat_result) -> None:
    d = rec.dst(rel)
    if not os.path.isdir(d):
        os.makedirs(d, exist_ok=True)
        rec.dirs += 1


def _make_link(rec: Recording, rel: str, target: str) -> None:
    d = rec.dst(rel)
    if os.path.lexists(d):
        return
    os.makedirs(os.path.dirname(d), exist_ok=True)
    if os.path.isabs(target):  # keep the replay inside OUT
        target = os.path.relpath(os.path.join(rec.out, target.lstrip("/")), os.path.dirname(d))
    os.symlink(target, d)
    rec.links += 1


def _read_text(path: str) -> tuple[str | None, str]:
    """(text, "") or (None, why not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as err:
        return None, err.strerror or str(err)
    data = b""
    try:
        while len(data) <= MAX_TEXT and (chunk := os.read(fd, MAX_TEXT + 1 - len(data))):
            data += chunk  # procfs gives a page a read: a route table is longer
    except OSError as err:
        return None, err.strerror or str(err)
    finally:
        os.close(fd)
    if len(data) > MAX_TEXT:
        return None, f"larger than {MAX_TEXT} bytes"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    return (None, "contains NUL bytes") if "\x00" in text else (text, "")


def _make_leaf(rec: Recording, rel: str, st: os.stat_result, content: bool) -> None:
    d = rec.dst(rel)
    name = os.path.basename(rel)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        if os.path.lexists(d):
            return
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        rec.devnodes["/" + rel] = {"type": kind, "major": major, "minor": minor}
        _placeholder(rec, d)
        # the sysfs attribute discovery falls back to when the node is not a real device
        _materialize(rec, ["sys", "dev", "char" if kind == "c" else "block", f"{major}:{minor}", "dev"], True)
        return
    if not (content and stat.S_ISREG(st.st_mode) and not DENY.match(name)):
        if not os.path.lexists(d) and rel not in rec.copied:
            _placeholder(rec, d)
        return
    if rel in rec.copied:
        return
    text, why = _read_text(rec.src(rel))
    if text is None:
        # an unreadable or binary attribute is left out: the replay sees it missing
        rec.skipped.append(f"/{rel}: {why}")
        if os.path.lexists(d):
            os.unlink(d)
            rec.placeholders -= 1
        rec.copied.add(rel)
        return
    if rec.redactor is not None:
        text = rec.redactor.text(name, text)
    existed = os.path.lexists(d)
    with open(d, "w", encoding="utf-8") as f:
        f.write(text)
    rec.copied.add(rel)
    rec.files += 1
    rec.placeholders -= existed


def _placeholder(rec: Recording, d: str) -> None:
    open(d, "w").close()
    rec.placeholders += 1


def _traced(root: str) -> list[tuple[str, str]]:
    """The scan's file operations on ``root``, each as what it touched (relative or not; a
    held directory is an ``opendir``, which records it as a directory)."""
    return [(plain_op(op), path) for op, path in traced_scan(root)[1] if op != "closedir"]


def _apply(rec: Recording, ops: list[tuple[str, str]], root: str) -> None:
    for op, path in ops:
        parts = _rel_parts(root, path)
        if parts is None or not parts:
            continue
        if op == "lstat" or op == "readlink":
            # the final component itself, not what it points to
            parent = _materialize(rec, parts[:-1], False) if len(parts) > 1 else []
            if parent is not None:
                _lstat_entry(rec, os.path.join(*parent, parts[-1]) if parent else parts[-1])
            continue
        resolved = _materialize(rec, parts, op == "open")
        if op in LISTINGS and resolved is not None:
            d = os.path.join(*resolved) if resolved else ""
            try:
                names = os.listdir(rec.src(d))
            except OSError:
                continue
            for name in names:
                _lstat_entry(rec, os.path.join(d, name) if d else name)


def _lstat_entry(rec: Recording, rel: str) -> None:
    """Reproduce one directory entry as what it is (no content, links not followed)."""
    try:
        st = os.lstat(rec.src(rel))
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        _make_link(rec, rel, os.readlink(rec.src(rel)))
    elif stat.S_ISDIR(st.st_mode):
        _make_dir(rec, rel, st)
    else:
        _make_leaf(rec, rel, st, False)


def _missed(rec: Recording, op: str, parts: list[str]) -> bool:
    """The replay touched something the source has but the recording lacks: a path, or
    the content of a file that was only a placeholder (e.g. a sysfs ``dev`` file the
    live scan never read because the real device node answered first)."""
    rel = os.path.join(*parts)
    if not os.path.lexists(rec.src(rel)):
        return False
    if not os.path.lexists(rec.dst(rel)):
        return True
    if op != "open" or not os.path.isfile(rec.dst(rel)):
        return False
    return os.path.relpath(os.path.realpath(rec.dst(rel)), os.path.realpath(rec.out)) not in rec.copied


def record(out: str, root: str = "/", redact: bool = False, redactor: Redactor | None = None, rounds: int = 4) -> Recording:
    """Record ``root`` into ``out`` (created; must be empty or missing)."""
    root = os.path.abspath(root)
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} is not empty")
    inside = [os.path.join(root, d) for d in ("sys", "proc")]
    if out == root or any(out == d or out.startswith(d + os.sep) for d in inside):
        raise ValueError(f"{out} must not be inside the recorded /sys or /proc")
    os.makedirs(out, exist_ok=True)
    rec = Recording(root, out, redactor or (Redactor() if redact else None))
    _apply(rec, _traced(root), root)
    _materialize(rec, ["proc", "devices"], True)  # major numbers for nodes not backed by sysfs
    for _ in range(rounds):  # replay; add what the replay asked for and the first pass missed
        replay_ops = _traced(out)
        missing = [(op, os.path.join(root, "/".join(parts))) for op, parts in
                   ((op, _rel_parts(out, p)) for op, p in replay_ops) if parts and _missed(rec, op, parts)]
        if not missing:
            break
        _apply(rec, missing, root)
    side = os.path.join(out, SIDE_DIR)
    os.makedirs(side, exist_ok=True)
    with open(os.path.join(side, "devnodes.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(rec.devnodes.items())), f, indent=2)
    with open(os.path.join(side, "skipped"), "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in sorted(set(rec.skipped))))
    with open(os.path.join(side, "README"), "w", encoding="utf-8") as f:
        f.write("Recorded by `sysdra record`" + (" with --redact" if rec.redactor else "") + f" from {root}.\n"
                "Replay: sysdra scan --root <this directory>\n"
                "devnodes.json: device nodes (placeholders here) with their type and major:minor.\n")
    return rec
