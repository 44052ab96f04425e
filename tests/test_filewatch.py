"""``agent.service.watch.FileWatch`` (the ``watchdog`` package's inotify observer): the file
events of fixture roots and the offline cluster directory, on real inotify, delivered on the
event loop."""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time

from agent.service.watch import FileWatch


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


class Seen:
    def __init__(self):
        self.paths: list[str] = []
        self.threads: set[int] = set()

    def __call__(self, path: str) -> None:
        self.paths.append(path)
        self.threads.add(threading.get_ident())

    async def until(self, path: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while path not in self.paths:
            if time.monotonic() > deadline:
                raise AssertionError(f"no event for {path}; got {self.paths[-10:]}")
            await asyncio.sleep(0.01)

    async def settle(self) -> None:
        await asyncio.sleep(0.2)


def test_changes_anywhere_below_are_reported_and_new_directories_are_watched(tmp_path):
    top = tmp_path / "sys"
    (top / "devices" / "fn").mkdir(parents=True)
    (top / "devices" / "fn" / "carrier").write_text("1\n")

    async def main():
        seen = Seen()
        watch = FileWatch([str(top)], seen)
        try:
            assert watch.complete
            (top / "devices" / "fn" / "carrier").write_text("0\n")
            await seen.until(str(top / "devices" / "fn" / "carrier"))
            assert seen.threads == {threading.get_ident()}, "a callback ran off the event loop's thread"
            os.makedirs(top / "devices" / "new" / "net" / "eth9")  # a tree at once
            await seen.until(str(top / "devices" / "new"))
            await seen.settle()
            (top / "devices" / "new" / "net" / "eth9" / "operstate").write_text("up\n")
            await seen.until(str(top / "devices" / "new" / "net" / "eth9" / "operstate"))
            src = tmp_path / "hotplug"
            (src / "a" / "b").mkdir(parents=True)
            (src / "a" / "b" / "vendor").write_text("0x8086\n")
            shutil.copytree(src / "a", top / "devices" / "a")
            await seen.until(str(top / "devices" / "a"))
            await seen.settle()
            (top / "devices" / "a" / "b" / "vendor").write_text("0x10de\n")
            await seen.until(str(top / "devices" / "a" / "b" / "vendor"))
            os.unlink(top / "devices" / "fn" / "carrier")
            await seen.until(str(top / "devices" / "fn" / "carrier"))
        finally:
            watch.stop()
    run(main())


def test_moved_and_removed_directories_keep_paths_right(tmp_path):
    top = tmp_path / "sys"
    (top / "x" / "deep").mkdir(parents=True)

    async def main():
        seen = Seen()
        watch = FileWatch([str(top)], seen)
        try:
            os.rename(top / "x", top / "y")
            await seen.until(str(top / "y"))
            await seen.settle()
            (top / "y" / "deep" / "f").write_text("1")
            await seen.until(str(top / "y" / "deep" / "f"))
            os.rename(top / "y", tmp_path / "outside")  # moved out of the tree: no longer watched
            await seen.until(str(top / "y"))
            await seen.settle()
            (tmp_path / "outside" / "deep" / "g").write_text("1")
            (top / "z").mkdir()
            await seen.until(str(top / "z"))
            await seen.settle()
            assert str(top / "x" / "deep" / "f") not in seen.paths, "a stale path was reported"
            assert not any("deep/g" in p for p in seen.paths), "a directory moved away is still watched"
        finally:
            watch.stop()
    run(main())


def test_symlinks_are_not_followed_and_non_recursive_watches_one_directory(tmp_path):
    top, elsewhere = tmp_path / "sys", tmp_path / "elsewhere"
    (top / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(elsewhere, top / "link")

    async def main():
        deep_seen, flat_seen = Seen(), Seen()
        deep, flat = FileWatch([str(top)], deep_seen), FileWatch([str(top)], flat_seen, recursive=False)
        try:
            (elsewhere / "f").write_text("1")
            (top / "sub" / "g").write_text("1")
            (top / "h").write_text("1")
            await deep_seen.until(str(top / "sub" / "g"))
            await flat_seen.until(str(top / "h"))
            await deep_seen.settle()
            assert not [p for p in deep_seen.paths + flat_seen.paths if p.endswith("/f")]
            assert str(top / "sub" / "g") not in flat_seen.paths
        finally:
            deep.stop()
            flat.stop()
    run(main())


FLOOD = """
import os, sys
done, files, count = sys.argv[1], sys.argv[2:4], int(sys.argv[4])
try:
    for i in range(count):
        os.utime(files[i % 2])  # alternate, so the kernel cannot merge them
finally:  # the test spins until this byte is written
    os.pwrite(os.open(done, os.O_WRONLY), b"1", 0)
"""


def test_a_queue_overflow_reports_the_root(tmp_path):
    """Events lost by the kernel (its queue overflowed while the reader could not read: here this
    thread keeps the interpreter lock meanwhile) are reported as the watched root: look at everything."""
    top = tmp_path / "sys"
    top.mkdir()
    files = [top / "a", top / "b"]
    for f in files:
        f.write_text("")
    done = tmp_path / "done"
    done.write_bytes(b"0")
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        limit = int(f.read())

    async def main():
        seen = Seen()
        watch = FileWatch([str(top)], seen)
        interval = sys.getswitchinterval()
        try:
            with open(done, "rb") as f, mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ) as flag:
                flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(done), *map(str, files), str(2 * limit)])
                sys.setswitchinterval(1000.0)  # the watcher's reader thread cannot take the lock meanwhile
                try:
                    while flag[0] != ord("1"):  # memory reads only: the lock is never let go
                        pass
                finally:
                    sys.setswitchinterval(interval)
                assert flood.wait() == 0
            await seen.until(str(top))
        finally:
            watch.stop()
    run(main())
