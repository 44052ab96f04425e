"""Publishing ResourceSlices: a reconciler (reconcile.py) over a store backend,
either the offline directory (dirstore.py) or the Kubernetes API (kubestore.py)."""

from agent.publish.reconcile import Reconciler, SyncStats
from agent.publish.store import Conflict, NotFound, SliceStore, StoreError

__all__ = ["Reconciler", "SyncStats", "SliceStore", "StoreError", "Conflict", "NotFound"]
