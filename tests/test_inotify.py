"""``agent.service.inotify.TreeWatch``: the file events of fixture roots and the offline
cluster directory, on real inotify."""

from __future__ import annotations

import asyncio
import os
import shutil

from agent.service.inotify import TreeWatch


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


class Seen:
    def __init__(self):
        self.paths: list[str] = []

    def __call__(self, path: str) -> None:
        self.paths.append(path)

    async def until(self, path: str, timeout: float = 5.0) -> None:
        for _ in range(int(timeout / 0.01)):
            if path in self.paths:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no event for {path}; got {self.paths[-10:]}")

    async def settle(self) -> None:
        await asyncio.sleep(0.2)


def test_changes_anywhere_below_are_reported_and_new_directories_are_watched(tmp_path):
    top = tmp_path / "sys"
    (top / "devices" / "fn").mkdir(parents=True)
    (top / "devices" / "fn" / "carrier").write_text("1\n")

    async def main():
        seen = Seen()
        watch = TreeWatch([str(top)], seen)
        try:
            assert watch.watched == 3 and watch.complete
            (top / "devices" / "fn" / "carrier").write_text("0\n")
            await seen.until(str(top / "devices" / "fn" / "carrier"))
            os.makedirs(top / "devices" / "new" / "net" / "eth9")  # a tree at once: watched before it is listed
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
        watch = TreeWatch([str(top)], seen)
        try:
            os.rename(top / "x", top / "y")
            await seen.until(str(top / "y"))
            await seen.settle()
            (top / "y" / "deep" / "f").write_text("1")
            await seen.until(str(top / "y" / "deep" / "f"))
            assert not any(p.startswith(str(top / "x") + "/") for p in seen.paths), "a stale path was reported"
            os.rename(top / "y", tmp_path / "outside")  # moved out of the tree: no longer watched
            await seen.until(str(top / "y"))
            await seen.settle()
            assert watch.watched == 1
            shutil.rmtree(tmp_path / "outside")
            (top / "z").mkdir()
            await seen.until(str(top / "z"))
            shutil.rmtree(top / "z")
            await seen.settle()
            assert watch.watched == 1  # the removed directory's watch is gone
        finally:
            watch.stop()
    run(main())


def test_symlinks_are_not_followed_and_non_recursive_watches_one_directory(tmp_path):
    top, elsewhere = tmp_path / "sys", tmp_path / "elsewhere"
    (top / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(elsewhere, top / "link")

    async def main():
        seen = Seen()
        deep, flat = TreeWatch([str(top)], seen), TreeWatch([str(top)], seen, recursive=False)
        try:
            assert deep.watched == 2 and flat.watched == 1
            (elsewhere / "f").write_text("1")
            (top / "sub" / "g").write_text("1")
            await seen.until(str(top / "sub" / "g"))
            await seen.settle()
            assert str(top / "link" / "f") not in seen.paths and str(elsewhere / "f") not in seen.paths
            assert seen.paths.count(str(top / "sub" / "g")) >= 1
        finally:
            deep.stop()
            flat.stop()
    run(main())


def test_a_queue_overflow_reports_the_root(tmp_path):
    top = tmp_path / "sys"
    top.mkdir()
    files = [top / "a", top / "b"]
    for f in files:
        f.write_text("")
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())

    async def main():
        seen = Seen()
        watch = TreeWatch([str(top)], seen)
        try:
            for i in range(limit + 10):  # the loop does not read meanwhile; alternate so events do not merge
                os.utime(files[i % 2])
            await seen.until(str(top))
        finally:
            watch.stop()
    run(main())
