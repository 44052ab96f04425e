"""The host group a container process needs to open a group-owned device node
(``cdi_additional_gids``, docs/kubelet-plugin.md "Non-root containers").

ROCm's ``/dev/kfd`` and ``/dev/dri/renderD*`` are ``root:render 0660``, Gaudi's ``/dev/accel/*``
and VFIO's group nodes likewise group-owned: a container running as a non-root user opens them
only as a member of that group. The CDI ``additionalGids`` edit (spec 0.7.0) adds the group to
the container process; runtimes on an older CDI library reject the whole spec file for it (the
field is unknown to their strict parser), hence the setting.

The node is read under the agent's ``--root`` (its view of the host), as untrusted input:
only a character or block node of the type and numbers the spec gives counts (whatever else is
at the path grants nothing), and any error means "no group" rather than a failed claim: the
container then gets the node as before.
"""

from __future__ import annotations

import logging
import os
import stat

from discovery.models import DeviceNode

log = logging.getLogger("cdi.nodegroup")

_TYPES = {"c": stat.S_ISCHR, "b": stat.S_ISBLK}


def node_group(node: DeviceNode) -> int | None:
    """The gid to add for ``node``: its host group when the group may read or write it
    (mode & 0o060) and is not root (0 adds nothing: runtimes ignore it); else None.
    Blocks on a stat: call it off the event loop (prepare runs in worker threads)."""
    try:
        st = os.lstat(node.host_path)  # a symlink is not the node: never followed
    except OSError as err:
        log.debug("device node %s: no group to add (%s)", node.host_path, err)
        return None
    is_type = _TYPES.get(node.type)
    if is_type is None or not is_type(st.st_mode) or st.st_rdev != os.makedev(node.major, node.minor):
        log.warning("device node %s is not the %s %d:%d the spec gives: no group added",
                    node.host_path, node.type, node.major, node.minor)
        return None
    if st.st_mode & 0o060 and st.st_gid != 0:
        return st.st_gid
    return None


def group_reader(setting: str):
    """``node_group`` when ``cdi_additional_gids`` is on, else None (specs without the field)."""
    return node_group if setting == "on" else None
