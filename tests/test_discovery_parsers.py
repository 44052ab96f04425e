"""Pure parsers and the reading primitive, on strings and small temp files."""

from __future__ import annotations

import glob
import os

import pytest

from discovery.devnodes import parse_dev, parse_proc_devices
from discovery.gpu import parse_nvidia_information
from discovery.models import NumaNode
from discovery.numa import close_nodes, parse_cpulist
from discovery.pci import BDF_RE, parse_id, parse_uevent, split_sysfs_path
from discovery.sysfs import AttrError, Dir, HostFS


def test_pci_addresses_may_have_wide_domains():
    assert BDF_RE.match("0000:1b:00.0").groups() == ("0000", "1b", "00", "0")
    assert BDF_RE.match("10000:02:00.7").groups() == ("10000", "02", "00", "7")
    for bad in ("0000:1b:00.8", "000:1b:00.0", "0000:1B:00.0", "0000:00:01.0:pcie001", ""):
        assert BDF_RE.match(bad) is None, bad


def test_parse_id():
    assert parse_id("0x10DE\n") == "10de"
    for bad in ("10de", "0x10de0", "0xzzzz", ""):
        with pytest.raises(ValueError):
            parse_id(bad)


_FIXTURE_UEVENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "fixtures/sysfs/*/sys/bus/pci/devices/*/uevent")


def _file(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def test_parse_uevent_says_what_the_attribute_files_say():
    """Every fixture function's uevent gives the ids and class of its ``vendor``, ``device``,
    ``class`` and ``subsystem_*`` files, and the driver its ``driver`` link names."""
    paths = sorted(glob.glob(_FIXTURE_UEVENTS))
    assert len(paths) > 20
    for path in paths:
        fields = parse_uevent(_file(path))
        if not fields:
            continue
        fn_dir = os.path.dirname(path)
        for name in ("vendor", "device", "subsystem_vendor", "subsystem_device"):
            if (text := _file(f"{fn_dir}/{name}")) is not None:
                assert fields[name] == parse_id(text), (path, name)
        if (text := _file(f"{fn_dir}/class")) is not None:
            assert fields["class"] == int(text, 16), path
        link = f"{fn_dir}/driver"
        assert fields["driver"] == (os.path.basename(os.readlink(link)) if os.path.islink(link) else None), path


_UEVENT = ("DRIVER=mlx5_core\nPCI_CLASS=20000\nPCI_ID=15B3:101E\nPCI_SUBSYS_ID=15B3:0041\n"
           "PCI_SLOT_NAME=0000:4f:01.0\nMODALIAS=pci:v000015B3d0000101Esv000015B3sd00000041bc02sc00i00")
_FIELDS = {"vendor": "15b3", "device": "101e", "subsystem_vendor": "15b3", "subsystem_device": "0041",
           "class": 0x20000, "driver": "mlx5_core"}  # fmt: skip


@pytest.mark.parametrize("change,differs", [
    (("DRIVER=mlx5_core\n", ""), {"driver": None}),  # no driver bound
    # no ids: not a PCI uevent, so no driver either (the caller reads the files and the link)
    (("PCI_ID=15B3:101E", "PCI_ID=zz"), {"vendor": ..., "device": ..., "driver": ...}),
    (("PCI_CLASS=20000", "PCI_CLASS=1234567"), {"class": ...}),
    (("\nPCI_SLOT_NAME=", "\nPCI_ID=1111:2222\nPCI_SLOT_NAME="), {"vendor": "1111", "device": "2222"}),  # the last wins
    (("\n", "\r\n"), {}),
    (("PCI_SUBSYS_ID=15B3:0041", "PCI_SUBSYS_ID=0x"), {"subsystem_vendor": ..., "subsystem_device": ...}),
    (("DRIVER=mlx5_core", "DRIVER=a/b"), {"driver": None}),
    (("DRIVER=mlx5_core", "DRIVER=a b"), {"driver": None}),
    (("MODALIAS=", "OF_NAME=x\nMODALIAS="), {}),
    (("PCI_SLOT_NAME", "pci_slot_name"), {}),
    (("MODALIAS=pci:", "MODALIAS=x\nDRIVER=late\nX="), {"driver": "late"}),
])  # fmt: skip
def test_parse_uevent_takes_well_formed_fields_only(change, differs):
    """Repeated keys, other line ends, lines the kernel does not print, values that are no
    ids: only well-formed fields are taken (``...``: the field is left out), and ``driver``
    only from a PCI uevent (None: no driver bound)."""
    want = {k: v for k, v in {**_FIELDS, **differs}.items() if v is not ...}
    assert parse_uevent(_UEVENT) == _FIELDS
    assert parse_uevent(_UEVENT.replace(*change)) == want


def test_split_sysfs_path_chain_and_vmd():
    assert split_sysfs_path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0") == (
        "pci0000:00",
        ("0000:00:01.0", "0000:01:00.0"),
    )
    # VMD: the nested pci10000:00 host bridge is not a new root complex
    root, bridges = split_sysfs_path("/sys/devices/pci0000:17/0000:17:05.5/pci10000:00/10000:00:02.0/10000:01:00.0")
    assert root == "pci0000:17" and bridges == ("0000:17:05.5", "10000:00:02.0")
    # virtio-net is one level deeper but the PCI chain is unchanged
    assert split_sysfs_path("/sys/devices/pci0000:00/0000:00:04.0") == ("pci0000:00", ())
    assert split_sysfs_path("/sys/bus/pci/devices/0000:00:04.0") == (None, ())
    assert split_sysfs_path("/sys/devices/pci0000:00/0000:00:04.0/virtio1") == ("pci0000:00", ())


def test_parse_dev_and_proc_devices():
    assert parse_dev("226:128\n") == (226, 128)
    with pytest.raises(ValueError):
        parse_dev("226")
    text = "Character devices:\n  1 mem\n195 nvidia-frontend\n510 nvidia-uvm\n\nBlock devices:\n  8 sd\n510 blk\n"
    assert parse_proc_devices(text) == {"mem": 1, "nvidia-frontend": 195, "nvidia-uvm": 510}


def test_parse_nvidia_information():
    text = (
        "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 45\nGPU UUID: \t GPU-1b2c\n"
        "Bus Location: \t 0000:1b:00.0\nDevice Minor: \t 3\nGPU Excluded:\t No\n"
    )
    info = parse_nvidia_information(text)
    assert info["Device Minor"] == "3" and info["Model"] == "NVIDIA H100 80GB HBM3" and info["GPU UUID"] == "GPU-1b2c"


def test_cpulist_and_numa_list_form():
    assert parse_cpulist("0-2,5,8-9\n") == [0, 1, 2, 5, 8, 9]
    with pytest.raises(ValueError):
        parse_cpulist("3-1")
    with pytest.raises(ValueError, match="more than 65536 CPUs"):  # 4 KiB of ranges, tens of millions of CPUs
        parse_cpulist(",".join(f"{i * 70000}-{i * 70000 + 65535}" for i in range(200)))
    # 4 nodes, 2 per socket (SNC-like): node 0 is closest to node 1 on its own socket
    nodes = (
        NumaNode(id=0, distances=(10, 12, 21, 21), socket=0),
        NumaNode(id=1, distances=(12, 10, 21, 21), socket=0),
        NumaNode(id=2, distances=(21, 21, 10, 12), socket=1),
        NumaNode(id=3, distances=(21, 21, 12, 10), socket=1),
    )
    assert close_nodes(0, nodes) == [0, 1]
    assert close_nodes(3, nodes) == [3, 2]
    # two sockets, one node each: the other node is at min distance but on another socket
    two = (NumaNode(id=0, distances=(10, 21), socket=0), NumaNode(id=1, distances=(21, 10), socket=1))
    assert close_nodes(0, two) == [0]
    assert close_nodes(5, two) == [5]


def test_read_primitive_errors(tmp_path):
    fs = HostFS(str(tmp_path))
    (tmp_path / "ok").write_text("0x10de\n")
    (tmp_path / "huge").write_bytes(b"1" * 100_000)
    (tmp_path / "latin1").write_bytes(b"\xff\xfe")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "nul").write_bytes(b"\0" * 1024)
    os.mkfifo(tmp_path / "fifo")
    os.symlink("loop", tmp_path / "loop")
    assert fs.read_attr(str(tmp_path / "ok")) == "0x10de"
    reasons = {}
    for name in ("huge", "latin1", "empty", "nul", "fifo", "loop", "missing"):
        with pytest.raises(AttrError) as exc:
            fs.read_attr(str(tmp_path / name))
        reasons[name] = exc.value.reason
    assert reasons == {
        "huge": "larger than 4096 bytes",
        "latin1": "not UTF-8",
        "empty": "empty",
        "nul": "contains NUL bytes",
        "fifo": "not a regular file",
        "loop": "symlink loop",
        "missing": "missing",
    }
    # an optional attribute: absent is None, every other failure the same error as read_attr's
    (tmp_path / "file").write_text("x\n")
    assert fs.read_optional(str(tmp_path / "ok")) == "0x10de"
    assert fs.read_optional(str(tmp_path / "missing")) is None
    for name in ("huge", "latin1", "empty", "nul", "fifo", "loop"):
        with pytest.raises(AttrError) as exc:
            fs.read_optional(str(tmp_path / name))
        assert exc.value.reason == reasons[name], name
    with pytest.raises(AttrError) as exc:  # a path through a file: ENOTDIR is no absence
        fs.read_optional(str(tmp_path / "file" / "speed"))
    assert exc.value.reason == "not a directory"
    # several of a directory at once, listed or not: the same text or the same error (its
    # path the file's), and absent ones left out
    names = ("ok", "huge", "latin1", "empty", "nul", "fifo", "loop", "missing")
    for d in (fs.list_dir(str(tmp_path)), Dir(str(tmp_path))):
        values, errors = fs.read_attrs(d, names)
        assert values == {"ok": "0x10de"}
        assert {name: err.reason for name, err in errors.items()} == {k: v for k, v in reasons.items() if k != "missing"}
        assert all(err.path == str(tmp_path / name) for name, err in errors.items())
    assert fs.link_name(str(tmp_path / "loop")) == "loop"
    # several links at once: the target's last name, or the error; absent ones left out
    os.symlink("..", tmp_path / "up")
    os.symlink("../devices/0000:01:00.0", tmp_path / "physfn")
    links = ("loop", "ok", "missing", "up", "physfn")
    for d in (fs.list_dir(str(tmp_path)), Dir(str(tmp_path))):
        found, errors = fs.link_names(d, links)
        assert found == {"loop": "loop", "physfn": "0000:01:00.0"}
        assert {n: e.reason for n, e in errors.items()} == {"ok": "invalid (EINVAL)", "up": "odd link target '..'"}
        assert all(e.path == str(tmp_path / n) for n, e in errors.items())
    # what the listing lacks is not looked for
    assert fs.link_names(Dir(str(tmp_path), {}), links) == ({}, {})
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "to-real")
    assert fs.list_dir(str(tmp_path / "real")).names is not None
    with pytest.raises(AttrError):  # a listing is of a real directory, never through a symlink
        fs.list_dir(str(tmp_path / "to-real"))


def test_contains_rejects_escapes(tmp_path):
    fs = HostFS(str(tmp_path))
    assert fs.contains(str(tmp_path / "sys/devices"))
    assert not fs.contains(os.path.normpath(str(tmp_path / "../etc")))


@pytest.mark.parametrize("root", ["/", "/host", "/host/", "//host", "host", "host//x/../y"])
def test_paths_under_a_root_are_the_ones_os_path_makes(root):
    """A scan makes thousands of paths under its root and checks one per PCI function, without
    os.path's general functions (HostFS.path, node_path): the answers os.path.join, contains()
    and rel() give, on roots and paths that are not normalised too."""
    fs = HostFS(root)
    for parts in (("sys/bus/pci/devices/0000:01:00.0",), ("/sys", "class", "net"), ("proc", "/abs"), ("a/",), ("",)):
        assert fs.path(*parts) == os.path.join(root, os.path.join(*parts).lstrip("/")), parts
    bare = root.rstrip("/") or "/"
    for host_path in (f"{bare}/sys/devices/pci0000:00", f"{bare}/a/../sys", f"{bare}//sys", bare, f"{bare}/..",
                      "/etc/passwd", f"{bare}x/sys", "sys/devices"):  # fmt: skip
        expected = fs.rel(host_path) if fs.contains(host_path) else None
        assert fs.node_path(host_path) == expected, host_path


def test_a_links_target_is_joined_as_os_path_joins_it(tmp_path):
    """resolve_link/follow join a target onto the link's directory without dirname and join (one
    per PCI function): normpath(join(dirname(link), target)), through doubled slashes too."""
    fs = HostFS(str(tmp_path))
    (tmp_path / "d").mkdir()
    for i, target in enumerate(("../../devices/pci0000:00/0000:00:01.0", "x", "/abs//y/", "a//b/../c", "..", "")):
        if target:
            os.symlink(target, tmp_path / "d" / f"l{i}")
        for link in (f"{tmp_path}/d/l{i}", f"{tmp_path}//d//l{i}"):
            if target:
                assert fs.resolve_link(link) == os.path.normpath(os.path.join(os.path.dirname(link), target)), link
            else:  # no link: follow gives the path itself
                assert fs.follow(link) == link


def test_whole_files_past_their_limit_and_a_file_swapped_for_a_link_after_the_listing(tmp_path):
    fs = HostFS(str(tmp_path))
    (tmp_path / "table").write_text("x" * 5000)
    assert len(fs.read_text(str(tmp_path / "table"), limit=5000)) == 5000
    with pytest.raises(AttrError, match="larger than 4999 bytes"):  # an error, never a table cut short
        fs.read_text(str(tmp_path / "table"), limit=4999)
    (tmp_path / "vendor").write_text("0x10de\n")
    (tmp_path / "elsewhere").write_text("0x8086\n")
    listed = fs.list_dir(str(tmp_path))  # "vendor" a regular file here
    os.unlink(tmp_path / "vendor")
    os.symlink("elsewhere", tmp_path / "vendor")
    values, errors = fs.read_attrs(listed, ("vendor",))
    assert values == {} and errors["vendor"].reason == "symlink loop"  # not followed
