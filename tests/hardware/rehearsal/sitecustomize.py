"""The rehearsal's NVML (tests/test_hardware_check.py): with this folder first on PYTHONPATH,
Python imports this module at start-up in every process of the real-GPU check (the check itself,
its ``sysdra`` commands, the agent it starts), and ``$SYSDRA_SIMNVML`` names the state file of the
simulated NVML (MIG and events, tests/simnvml_mig.py) they all share: the NVML discovery/nvml.py
opens, 'loaded' from the fixture's driver root, and ``pynvml`` for the check's own NVML reads.

A stand-in because no NVIDIA driver can run here; on a lent GPU the check runs the real one.
"""

import os
import sys

if os.environ.get("SYSDRA_SIMNVML"):
    from tests import simnvml_mig

    sys.modules["pynvml"] = simnvml_mig.install_from_env()
