"""Accelerators of the DRM accel class (discovery/accel.py) on the accel-gaudi fixture: a Gaudi's
module ID is published, its habanalabs status and accel node are in the inventory (``sysdra
scan``), the first accel node by number (not by name: accel10 comes after accel2), and a status
that cannot be read is a problem of that device."""

from __future__ import annotations

import os
import shutil

from discovery.inventory import scan
from discovery.models import AccelInfo
from tests.conftest import profile_root

GAUDI = "accelerator-0000-17-00-0"
SYSFS = "sys/bus/pci/devices/0000:17:00.0"


def test_a_gaudis_module_id_status_and_accel_node():
    dev = scan(profile_root("accel-gaudi")).by_name()["accelerator-0000-99-00-0"]
    assert dev.accel == AccelInfo(accel="accel3", status="in reset", module_id=2)
    assert dev.attributes["moduleID"].int_ == 2


def test_the_first_accel_node_by_number_and_an_unreadable_status(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(profile_root("accel-gaudi"), root, symlinks=True)
    extra = root / SYSFS / "accel/accel10"
    extra.mkdir()
    (extra / "dev").write_text("261:10\n")
    os.unlink(root / SYSFS / "status")
    dev = scan(str(root)).by_name()[GAUDI]
    assert dev.accel.accel == "accel2" and dev.accel.status is None and dev.accel.module_id == 0
    assert "/dev/accel/accel10" in {n.path for n in dev.device_nodes}
    assert any(p.what == "status" and p.reason == "missing" for p in dev.problems)
