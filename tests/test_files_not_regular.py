"""Files the agent reads back that are no regular file of a sane size: a FIFO, a symlink to
/dev/zero or a sparse file of gigabytes where the settings file, the checkpoint, a record file, a
CDI spec or a slice file should be. Each was opened blocking or read without a bound: the agent
hung at start for ever (a FIFO: open() waits for a writer), or read until memory ran out. Each is
now that file's own error, as for a damaged one (agent/fsutil.py ``read_bounded``).

Every read runs in a child process with a bounded address space and a deadline: an unbounded read
there ends in MemoryError and a hang in the deadline, never in this machine's OOM killer."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

import pytest

from agent.fsutil import FileRefused, read_bounded
from agent.prepare.checkpoint import Checkpoint
from tests.test_nvidia_driver import write_hook

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_MEMORY = 1 << 30  # the child's address space: enough for the imports, not for a sparse file
SPARSE = 8 << 30
KINDS = ("fifo", "zero", "sparse")


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def _child(code: str) -> str:
    """``code``'s last line of output, run in a child (hang guard only: no duration asserted)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, preexec_fn=_limit)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _spoil(path: str, kind: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(SPARSE)


# reader: (file name in the temp dir, code printing the outcome; P is the file, D the temp dir)
READERS = {
    "settings": ("config.yaml", "from agent.settings import ConfigError, load_config_file\n"
                 "try: load_config_file(P)\nexcept ConfigError as e: print('ERR', e)"),
    "checkpoint": ("checkpoint.json", "from agent.prepare.checkpoint import Checkpoint, CheckpointError\n"
                   "try: Checkpoint.load(P)\nexcept CheckpointError as e: print('ERR', e)"),
    "journal": ("checkpoint.json.journal", "from agent.prepare.checkpoint import Checkpoint, CheckpointError\n"
                "try: Checkpoint.load(D + '/checkpoint.json')\nexcept CheckpointError as e: print('ERR', e)"),
    "unprepare marks": ("unprepared.json", "from agent.kubeletplugin.unprepared import SharedMarks\n"
                        "print(SharedMarks(D, boot_id='b').after({'u'}, 0.0) or 'none')"),
    "skip-node-operations": ("skip-node-operations.json", "from agent.service.nodeops import load_applied\n"
                             "print(load_applied(D))"),
    "mps records": ("mps.json", "from agent.prepare.mps_records import load\nprint(load(P).daemons or 'none')"),
    "cdi spec": ("claim.json", "from agent.prepare.cdifiles import SpecError, read_spec\n"
                 "try: read_spec(P)\nexcept SpecError as e: print('ERR', e)"),
    "metadata": ("metadata.json", "from agent.prepare.metadata.stream import MetadataError, read_file\n"
                 "try: read_file(P)\nexcept MetadataError as e: print('ERR', e)"),
    "nvidia cdi spec": ("nvidia.yaml", "from agent.prepare.nvidia import _load\nprint(_load(P))"),
    "slice file": ("resourceslices/s.json", "from agent.publish.dirstore import DirStore\n"
                   "print(DirStore(D, node_name='n', driver_name='d')._read('s'))"),
    "if_inet6 under the root": ("proc/1/net/if_inet6", "from agent.prepare.netaddrs import addresses\n"
                                "print(addresses(D))"),
    "process name under the root": ("proc/123/comm", "import os\nfrom agent.prepare.devusers import holders\n"
                                    "print(holders(D, {os.stat('/dev/null').st_rdev}).holders[0].comm)"),
    "a cdi hook under the driver root": ("usr/bin/nvidia-cdi-hook.real", "from discovery.nvidia_driver import "
                                         "find_driver_files\nprint(find_driver_files(D).cuda_compat)"),
    "doctor: containerd's config": ("config.toml", "from agent.tools.doctor_runtime import check_containerd\n"
                                    "print(check_containerd(D, '/s', '/c', path=P)[0].message)"),
    "doctor: a CRI-O drop-in": ("crio.conf.d/10-x.conf", "from agent.tools.doctor_crio import check_crio\n"
                                "print(check_crio(D, '/s', '/c', D + '/none', D + '/crio.conf.d')[0].message)"),
    "doctor: a cdi dir's spec": ("other.yaml", "from agent.tools.doctor_files import check_cdi_spec\n"
                                 "print(check_cdi_spec(P)[0][0].message)"),
    "doctor: a metadata file": ("dra-device-metadata/m/metadata.json", "from agent.tools.doctor_files import check_metadata\n"
                                "print(check_metadata(D)[0].message)"),
}
# what each says of the file (its own error, as for damage: tests/test_*_damaged.py)
EXPECTED = {
    "settings": "ERR config file {P}: {why}",
    "checkpoint": "ERR {P} cannot be read ({why})",
    "journal": "ERR {P} cannot be read ({why})",
    "unprepare marks": "none",
    "skip-node-operations": "None",
    "mps records": "none",
    "cdi spec": "ERR {P}: {why}",
    "metadata": "ERR {P}: {why}",
    "nvidia cdi spec": "None",
    "slice file": "None",
    "if_inet6 under the root": "{{}}",
    "process name under the root": "?",  # the holder named by its pid alone
    "a cdi hook under the driver root": "False",  # (what the hook cannot do: enable-cuda-compat)
    "doctor: containerd's config": "{P}: cannot read it: {why}",
    "doctor: a CRI-O drop-in": "{P}: cannot read it: {why}",
    "doctor: a cdi dir's spec": "does not parse: {why}",
    "doctor: a metadata file": "not a complete JSON stream: {why}",  # a claim's status without the host's addresses, its prepare not held up
}


def _why(kind: str, name: str) -> str:
    if kind == "sparse":
        return f"{SPARSE} bytes, more than N"  # (N: that kind of file's bound)
    return "not a regular file: " + ("a FIFO" if kind == "fifo" else "a character device")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_a_file_that_is_no_regular_file_is_that_files_error(tmp_path, reader, kind):
    name, code = READERS[reader]
    path = str(tmp_path / name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if reader == "journal":  # a snapshot and its journal, as the agent leaves them
        cp = Checkpoint.load(str(tmp_path / "checkpoint.json"))
        cp.compact()
    if reader == "a cdi hook under the driver root":  # a hook without the word: the .real one is looked into
        write_hook(str(tmp_path / "usr/bin/nvidia-cdi-hook"), compat=False)
    if reader == "process name under the root":  # a process of the root's procfs holding a device open
        os.makedirs(tmp_path / "proc/123/fd")
        os.symlink("/dev/null", tmp_path / "proc/123/fd/3")
    _spoil(path, kind)
    out = _child(f"D, P = {str(tmp_path)!r}, {path!r}\n{code}")
    expected = EXPECTED[reader].format(P=path, why=_why(kind, name))
    assert re.sub(r"more than \d+", "more than N", out).startswith(expected), out


def test_sysdra_run_with_a_fifo_for_its_config_exits_78(tmp_path):
    path = tmp_path / "config.yaml"
    os.mkfifo(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    done = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr[-2000:]
    assert done.stderr == f"sysdra: config file {path}: not a regular file: a FIFO\n"


def test_the_reader_takes_dev_null_as_empty_and_a_directory_as_open_does(tmp_path):
    assert read_bounded(os.devnull, 10) == b""
    with pytest.raises(IsADirectoryError):
        read_bounded(str(tmp_path), 10)
    (tmp_path / "f").write_bytes(b"x" * 11)
    with pytest.raises(FileRefused, match="^11 bytes, more than 10$"):
        read_bounded(str(tmp_path / "f"), 10)
    assert read_bounded(str(tmp_path / "f"), 11) == b"x" * 11
