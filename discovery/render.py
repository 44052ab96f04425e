"""Human output of an inventory: a table, and a NUMA -> root complex -> bridges tree."""

from __future__ import annotations

from collections import defaultdict

from discovery.models import Device, Inventory


def _nodes(dev: Device) -> str:
    return ",".join(n.path.removeprefix("/dev/") for n in dev.device_nodes) or "-"


def _partitions(dev: Device) -> str:
    """`` CPX/NPS1: 8 partitions`` / `` MIG: 4 instances`` for a partitioned GPU."""
    pt = dev.gpu.partitioning if dev.gpu is not None else None
    if pt is None or (pt.kind == "amd" and not pt.switchable and len(pt.partitions) <= 1):
        return ""
    if pt.kind == "mig":
        names = sorted({p.profile.name for p in pt.partitions if p.profile is not None})  # static MIG with NVML
        return (f"  MIG: {len(pt.partitions)} instances" + (f" ({', '.join(names)})" if names else "")
                + (f", {len(pt.profiles)} profiles (NVML)" if pt.profiles else ""))
    return f"  {pt.compute_mode}/{pt.memory_mode}: {len(pt.partitions)} partitions"


def _row(dev: Device) -> list[str]:
    fn = dev.pci
    numa = "-" if fn.numa_node is None else str(fn.numa_node)
    return [dev.name, dev.kind, fn.bdf, f"{fn.vendor_id}:{fn.device_id}", fn.driver or "-", numa,
            fn.pcie_root or "-", _nodes(dev), str(len(dev.problems)) if dev.problems else ""]  # fmt: skip


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines) + "\n"


def render_table(inv: Inventory) -> str:
    out = []
    header = ["NAME", "KIND", "PCI", "ID", "DRIVER", "NUMA", "ROOT", "DEVICE NODES", "PROBLEMS"]
    out.append(_table(header, [_row(d) for d in inv.devices]) if inv.devices else "no devices found\n")
    if inv.skipped:
        out.append(f"\n{len(inv.skipped)} PCI functions not offered:\n")
        out.append(_table(["PCI", "REASON"], [[s.bdf, s.reason] for s in inv.skipped]))
    problems = [(d.name, p) for d in inv.devices for p in d.problems] + [("node", p) for p in inv.problems]
    if problems:
        out.append("\nproblems (the value is left out, the rest is published):\n")
        out.append(_table(["WHERE", "WHAT", "REASON"], [[w, p.what, p.reason] for w, p in problems]))
    return "".join(out)


def render_tree(inv: Inventory) -> str:
    """NUMA node -> PCIe root complex -> bridge chain -> devices (GPU/NIC affinity at a glance)."""
    cpus = {n.id: n.cpulist for n in inv.numa_nodes}
    by_numa: dict = defaultdict(lambda: defaultdict(list))
    for dev in inv.devices:
        by_numa[dev.pci.numa_node][dev.pci.pcie_root or "(no root complex)"].append(dev)
    lines: list[str] = []
    for numa in sorted(by_numa, key=lambda n: (n is None, n if n is not None else 0)):
        if numa is None:
            lines.append("numa node unknown")
        else:
            lines.append(f"numa node {numa}" + (f" (cpus {cpus[numa]})" if cpus.get(numa) else ""))
        roots = by_numa[numa]
        for ri, root in enumerate(sorted(roots)):
            last_root = ri == len(roots) - 1
            lines.append(("└── " if last_root else "├── ") + root)
            _subtree(roots[root], 0, "    " if last_root else "│   ", lines)
    return "\n".join(lines) + "\n" if lines else "no devices found\n"


def _subtree(devs: list[Device], depth: int, prefix: str, lines: list[str]) -> None:
    here = [d for d in devs if len(d.pci.bridges) <= depth]
    below: dict[str, list[Device]] = defaultdict(list)
    for d in devs:
        if len(d.pci.bridges) > depth:
            below[d.pci.bridges[depth]].append(d)
    entries = [("dev", d.name, d) for d in sorted(here, key=lambda d: d.pci.bdf)]
    entries += [("bridge", b, below[b]) for b in sorted(below)]
    for i, (what, label, item) in enumerate(entries):
        last = i == len(entries) - 1
        branch = "└── " if last else "├── "
        if what == "dev":
            d = item
            lines.append(f"{prefix}{branch}{d.pci.bdf}  {d.name}  {d.pci.vendor_id}:{d.pci.device_id} {d.pci.driver or '-'}  [{_nodes(d)}]{_partitions(d)}")
        else:
            lines.append(f"{prefix}{branch}{label} (bridge)")
            _subtree(item, depth + 1, prefix + ("    " if last else "│   "), lines)
