"""A stand-in for ``nvidia-cuda-mps-control`` (no NVIDIA driver can run here). Like the real one,
``-f`` serves as the control daemon in the foreground on a unix socket ``control`` in
``$CUDA_MPS_PIPE_DIRECTORY`` (what it was started with logged to
``$CUDA_MPS_LOG_DIRECTORY/control.log``) and answers one command per connection:
``get_server_list`` (no servers: an empty answer), ``quit`` (it removes its socket and exits);
without arguments it is the client: its stdin to the daemon, the answer to stdout, exit 1 when no
daemon answers. As the daemon it writes ``/dev/shm/fake-mps-<pid>`` (what its servers would
share with clients), but only where ``/dev/shm`` is the tmpfs the agent mounted at the pipe dir's
sibling ``shm`` (a run by hand on a host leaves nothing in the host's /dev/shm); control.log says
which. ``FAKE_MPS_NO_PIPE=1`` makes a daemon that never opens its socket (a start that
fails); ``FAKE_MPS_MUTE=1`` one that accepts but never answers."""

import os
import socket
import sys
import time

os.chdir(os.environ["CUDA_MPS_PIPE_DIRECTORY"])  # a test's path can be longer than a socket address
control = "control"


def serve() -> None:
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as log:
        log.write(f"started pid {os.getpid()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}\n")
        try:
            ours = os.stat("/dev/shm").st_dev == os.stat(os.path.join("..", "shm")).st_dev
        except OSError:
            ours = False
        if ours:
            with open(f"/dev/shm/fake-mps-{os.getpid()}", "w") as mark:
                mark.write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        log.write(f"/dev/shm is {'the' if ours else 'not the'} shm dir\n")
    if os.environ.get("FAKE_MPS_NO_PIPE"):
        time.sleep(3600)
    # bound and listening under another name, then renamed: the agent takes ``control`` appearing
    # for the daemon being ready, and a client between bind and listen would be refused. The
    # rename also replaces a socket left by a killed daemon, as the real one does.
    if os.path.exists(control + ".new"):
        os.remove(control + ".new")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(control + ".new")
    srv.listen(8)
    os.rename(control + ".new", control)
    while True:
        conn, _ = srv.accept()
        with conn:
            command = conn.recv(4096).decode().strip()
            if os.environ.get("FAKE_MPS_MUTE"):
                time.sleep(3600)
            if command == "quit":
                os.remove(control)
                sys.exit(0)
            conn.sendall(b"" if command == "get_server_list" else f"unknown command {command}\n".encode())


def client() -> int:
    try:
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(control)
            c.sendall(sys.stdin.read().encode())
            c.shutdown(socket.SHUT_WR)
            sys.stdout.write(c.recv(4096).decode())
    except OSError as err:
        print(f"Cannot find MPS control daemon process ({err})", file=sys.stderr)
        return 1
    return 0


if sys.argv[1:] == ["-f"]:
    serve()
else:
    sys.exit(client())
