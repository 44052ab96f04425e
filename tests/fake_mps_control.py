"""A stand-in for ``nvidia-cuda-mps-control`` (no NVIDIA driver can run here): ``-f`` serves
as the control daemon in the foreground (its ``control`` FIFO in ``$CUDA_MPS_PIPE_DIRECTORY``,
what it was started with logged to ``$CUDA_MPS_LOG_DIRECTORY/control.log``) until it reads
``quit``; without arguments it is the client, sending its stdin to the daemon's FIFO.
``FAKE_MPS_NO_PIPE=1`` makes a daemon that never opens its pipe (a start that fails)."""

import os
import sys
import time

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
control = os.path.join(pipe, "control")
if sys.argv[1:] == ["-f"]:
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as log:
        log.write(f"started pid {os.getpid()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}\n")
    if os.environ.get("FAKE_MPS_NO_PIPE"):
        time.sleep(3600)
    os.mkfifo(control)
    while True:
        with open(control) as f:  # blocks until a client writes
            if "quit" in f.read():
                os.remove(control)
                sys.exit(0)
else:
    with open(control, "w") as f:
        f.write(sys.stdin.read())
