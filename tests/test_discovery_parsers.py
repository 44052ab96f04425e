"""Pure parsers and the reading primitive, on strings and small temp files."""

from __future__ import annotations

import glob
import os

import pytest

from discovery.devnodes import parse_dev, parse_proc_devices
from discovery.gpu import parse_nvidia_information
from discovery.models import NumaNode
from discovery.numa import close_nodes, parse_cpulist
from discovery.pci import _KERNEL_HEAD, _kernel_head, parse_bdf, parse_id, parse_uevent, split_sysfs_path, uevent_lines
from discovery.sysfs import AttrError, Dir, HostFS


def test_parse_bdf_accepts_wide_domains():
    assert parse_bdf("0000:1b:00.0") == ("0000", 0x1B, 0, 0)
    assert parse_bdf("10000:02:00.7") == ("10000", 2, 0, 7)
    for bad in ("0000:1b:00.8", "000:1b:00.0", "0000:1B:00.0", "0000:00:01.0:pcie001", ""):
        with pytest.raises(ValueError):
            parse_bdf(bad)


def test_parse_id():
    assert parse_id("0x10DE\n") == "10de"
    for bad in ("10de", "0x10de0", "0xzzzz", ""):
        with pytest.raises(ValueError):
            parse_id(bad)


_FIXTURE_UEVENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "fixtures/sysfs/*/sys/bus/pci/devices/*/uevent")


def _uevent_texts(pattern: str = _FIXTURE_UEVENTS) -> list[str]:
    """The PCI uevents a glob finds, as ``attrs`` hands them over (stripped)."""
    texts = []
    for path in sorted(glob.glob(pattern)):
        with open(path, errors="replace") as f:
            if "PCI_ID=" in (text := f.read().strip()):
                texts.append(text)
    return texts


def test_parse_uevent_reads_the_kernels_form_in_one_match():
    """The kernel's own text (the fixtures' uevents) is taken by its head, matched once per
    distinct head, and says what reading line by line says; so does this machine's, whatever
    form its platform prints."""
    texts = _uevent_texts()
    assert len(texts) > 20
    _kernel_head.cache_clear()
    for text in texts:
        head = text.partition("\nPCI_SLOT_NAME=")[0]
        assert _KERNEL_HEAD.fullmatch(head), text
        misses = _kernel_head.cache_info().misses
        parse_uevent(text)
        assert _kernel_head.cache_info().misses <= misses + 1  # the head was asked, once at most
    assert _kernel_head.cache_info().currsize < len(texts)  # functions of one model and driver share a head
    for text in texts + _uevent_texts("/sys/bus/pci/devices/*/uevent"):
        assert list(parse_uevent(text).items()) == list(uevent_lines(text).items())
    assert parse_uevent(texts[0].partition("\n")[2] if texts[0].startswith("DRIVER=") else texts[0])["driver"] is None


def test_parse_uevent_heads_table_is_bounded():
    """The table of heads is bounded (an agent that sees ever new drivers or ids): the oldest
    goes, and a head read again after that gives the same fields."""
    _kernel_head.cache_clear()
    size = _kernel_head.cache_info().maxsize
    texts = [f"DRIVER=d{i}\nPCI_CLASS=20000\nPCI_ID=15B3:101E\nPCI_SUBSYS_ID=15B3:0041\n"
             f"PCI_SLOT_NAME=0000:4f:01.{i % 8}\nMODALIAS=pci:v000015B3" for i in range(size + 1)]  # fmt: skip
    first = [parse_uevent(t) for t in texts[:2]]
    assert _kernel_head.cache_info().currsize == 2
    assert parse_uevent(texts[-1])["driver"] == f"d{size}"
    assert [parse_uevent(t)["driver"] for t in texts[2:-1]] == [f"d{i}" for i in range(2, size)]
    assert _kernel_head.cache_info().currsize == size
    misses = _kernel_head.cache_info().misses
    assert [parse_uevent(t) for t in texts[:2]] == first == [uevent_lines(t) for t in texts[:2]]
    assert _kernel_head.cache_info().misses == misses + 2  # both had gone
    assert first[0]["vendor"] == "15b3" and first[0]["class"] == 0x20000
    first[0]["vendor"] = "changed by the caller"  # the reader adds and replaces fields
    assert parse_uevent(texts[0])["vendor"] == "15b3"
    _kernel_head.cache_clear()


@pytest.mark.parametrize("change", [
    ("PCI_ID=", "PCI_ID=zz"), ("PCI_CLASS=", "PCI_CLASS=1234567"), ("\nPCI_SLOT_NAME=", "\nPCI_ID=1111:2222\nPCI_SLOT_NAME="),
    ("MODALIAS=pci:", "MODALIAS=x\x1ePCI_ID=3333:4444\x1e"), ("MODALIAS=pci:", "MODALIAS=x\u2028DRIVER=late\u2028"),
    ("\n", "\r\n"), ("PCI_SUBSYS_ID=", "PCI_SUBSYS_ID=0x"), ("DRIVER=", "DRIVER=a/b\nX="), ("DRIVER=", "DRIVER=a b\nX="),
    ("MODALIAS=", "OF_NAME=x\nMODALIAS="), ("PCI_SLOT_NAME", "pci_slot_name"),
    ("PCI_SLOT_NAME=", "PCI_SLOT_NAME=a b\x85DRIVER=late "), ("PCI_SLOT_NAME=", "PCI_SLOT_NAME=a b "),
    ("MODALIAS=pci:", "MODALIAS=pci:\tx"),
])  # fmt: skip
def test_parse_uevent_any_other_text_is_read_line_by_line(change):
    """Texts off the kernel's form (repeated keys, other separators, lines the kernel does not
    print, values that are no ids) give what the line-by-line reading gives."""
    text = next(t for t in _uevent_texts() if t.startswith("DRIVER="))
    parse_uevent(text)  # its head known: a changed tail must still be looked at
    changed = text.replace(*change)
    assert changed != text
    assert list(parse_uevent(changed).items()) == list(uevent_lines(changed).items())


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
    # the function's own (checked) address as the last component: the same answer
    for path in ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0",
                 "/sys/devices/pci0000:17/0000:17:05.5/pci10000:00/10000:00:02.0/10000:01:00.0"):  # fmt: skip
        assert split_sysfs_path(path, path.rpartition("/")[2]) == split_sysfs_path(path)
        assert split_sysfs_path(path, "0000:ff:00.0") == split_sysfs_path(path)
    assert split_sysfs_path("/sys/devices/pci0000:00/0000:00:04.0/virtio1", "0000:00:04.0") == ("pci0000:00", ())


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
    assert fs.read_present(str(tmp_path / "missing")) is None
    for name in ("huge", "latin1", "empty", "nul", "fifo", "loop"):
        with pytest.raises(AttrError) as exc:
            fs.read_optional(str(tmp_path / name))
        assert exc.value.reason == reasons[name], name
    with pytest.raises(AttrError) as exc:  # a path through a file: ENOTDIR is no absence
        fs.read_optional(str(tmp_path / "file" / "speed"))
    assert exc.value.reason == "not a directory"
    # several of a listed directory at once, by path and through the held directory: the same
    # text or the same error (its path the file's), and what the listing lacks left out
    names = ("ok", "huge", "latin1", "empty", "nul", "fifo", "loop", "missing")
    d = fs.list_dir(str(tmp_path))
    fd = fs.open_dir(str(tmp_path))
    try:
        # by path, listed and through the held directory; unlisted (each name's type asked)
        for how in ((d, None), (fs.list_dir(str(tmp_path), fd), fd), (Dir(str(tmp_path)), None)):
            errors: dict = {}
            assert fs.attrs(how[0], names, errors, how[1]) == {"ok": "0x10de"}
            assert {name: err.reason for name, err in errors.items()} == {k: v for k, v in reasons.items() if k != "missing"}
            assert all(err.path == str(tmp_path / name) for name, err in errors.items())
    finally:
        os.close(fd)
    assert fs.link_name(str(tmp_path / "loop")) == "loop"
    # several links at once: the target's last name, or the error; absent ones left out
    os.symlink("..", tmp_path / "up")
    os.symlink("../devices/0000:01:00.0", tmp_path / "physfn")
    links = ("loop", "ok", "missing", "up", "physfn")
    want = {"ok": "invalid (EINVAL)", "up": "odd link target '..'"}
    fd = fs.open_dir(str(tmp_path))
    try:
        for how in ((fs.list_dir(str(tmp_path)), None), (Dir(str(tmp_path)), None), (fs.list_dir(str(tmp_path), fd), fd)):
            errors = {}
            got = fs.link_names(how[0], links, errors, how[1])
            assert got == {"loop": "loop", "physfn": "0000:01:00.0"}
            assert {n: e.reason for n, e in errors.items()} == want
            assert all(e.path == str(tmp_path / n) for n, e in errors.items())
    finally:
        os.close(fd)
    # what the listing lacks is not looked for
    errors = {}
    assert fs.link_names(Dir(str(tmp_path), {}, {}.keys()), links, errors) == {} and errors == {}


def test_contains_rejects_escapes(tmp_path):
    fs = HostFS(str(tmp_path))
    assert fs.contains(str(tmp_path / "sys/devices"))
    assert not fs.contains(os.path.normpath(str(tmp_path / "../etc")))
