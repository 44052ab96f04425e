"""Read-only hardware discovery over a host root: sysfs/procfs/dev -> frozen inventory."""
