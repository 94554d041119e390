"""A parent that has imported the frameworks once, and forks the tests' recipe processes from it.

Why: a recipe's process spends ~4 CPU-seconds importing torch (and torch._dynamo, which the optimizers pull in),
DeepSpeed and megatron-core before its first step, and a tiny test run trains for well under a second. A 2-rank
torchrun pays that three times (the agent and both ranks). Forked from this parent, each process starts with
those modules already imported, and runs the recipe file as `python recipe.py ARGS` would: its own argv,
environment, working directory, `sys.path[0]`, `__name__ == "__main__"`, standard streams, exit code. Rank sets
get torchrun's variables and its fail-fast rule (one rank fails: the others are stopped).

It is the tests' own launcher, for runs on this machine outside Slurm and containers (tests/support/runs.py);
jobs, containers, accelerate/horovodrun/mpiexec and the tests about warnings, signals and torchrun itself
start real processes. tests/test_forked_launch.py runs each recipe both ways and fails if they differ.

Protocol (a Unix socket; one request per connection): the client sends a length-prefixed JSON request with its
stdout and stderr file descriptors attached (SCM_RIGHTS); the server answers one JSON line with the process
group and pids once they are started, and a second with every rank's exit status once all have ended
(negative: the signal that ended it, as subprocess reports it). It ends when its standard input closes (the
test worker that started it is gone), killing what it started.

    python tests/support/forkserver.py SOCKET_PATH
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import warnings

# Stop the other ranks this long after one failed, then kill them (torchrun's agent does the same, in its time).
STOP_GRACE_S = 5.0
HEADER = struct.Struct("!Q")
FRESH_WARNING_FILTERS = list(warnings.filters)  # CPython's defaults and -W/PYTHONWARNINGS, before any import


def preload() -> None:
    """What the recipes import before their first step, imported once here. Nothing that reads the per-run
    environment at import time (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE then, which the harness sets
    per run): transformers, peft and the trackers are imported by each run itself, as today."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (what recipes/harness/model.py sets on a machine without CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (megatron's "Apex is not installed": each run filters or sees its own)
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.pipelining  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
        import torch.utils.data  # noqa: F401
        import accelerate  # noqa: F401
        import deepspeed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.distributed  # noqa: F401
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a thread would not exist in the children, and whatever it held would stay held there
        raise SystemExit(f"forkserver: {threads} threads after the imports (OMP_NUM_THREADS=1 keeps it to one)")


def run_child(request: dict, rank: int, out_fd: int, err_fd: int, keep_closed: list[int]) -> None:
    """In the forked process: become `python SCRIPT ARGS` with this rank's environment; never returns."""
    code = 1
    try:
        for fd in keep_closed:  # (the server's sockets and pidfds; its stdin pipe is fd 0, replaced below)
            if fd > 2:
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, target)
        for fd in {devnull, out_fd, err_fd} - {0, 1, 2}:
            os.close(fd)
        for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (SIGPIPE stays ignored, as CPython sets it)
        os.environ.clear()
        os.environ.update(request["env"][rank])
        apply_malloc_environment(os.environ)
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        warnings.filters[:] = FRESH_WARNING_FILTERS  # (the preload's warnings do not count as already shown)
        warnings._filters_mutated()
        code = run_script(script)
    finally:
        os._exit(code)


def apply_malloc_environment(environ) -> None:
    """glibc reads MALLOC_MMAP_THRESHOLD_ when a process starts; a forked rank started long ago, so it is set as
    glibc would set it (mallopt M_MMAP_THRESHOLD, which also ends the threshold's dynamic growth)."""
    value = environ.get("MALLOC_MMAP_THRESHOLD_")
    if value:
        import ctypes

        M_MMAP_THRESHOLD = -3
        if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(value)) != 1:
            raise SystemExit(f"forkserver: mallopt(M_MMAP_THRESHOLD, {value}) failed")


def run_script(script: str) -> int:
    """Run ``script`` as __main__; the exit status CPython would give (SystemExit's code, 1 after a traceback),
    after the same shutdown: non-daemon threads joined, atexit handlers run, streams flushed."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (KeyboardInterrupt too: a fresh interpreter prints it and exits 1)
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream: nothing left to flush)
                pass
    return code & 0xFF


def join_group(pgid: int, pid: int = 0) -> None:
    """Rank 0 leads a new process group, the other ranks join it: one killpg stops them all."""
    try:
        os.setpgid(pid, pgid)
    except (PermissionError, ProcessLookupError):  # (the child already ran exec-free to its end, or joined itself)
        pass


class Group:
    """The ranks of one request: their pids, pidfds and exit statuses, and the connection to answer."""

    def __init__(self, conn: socket.socket, pids: list[int]):
        self.conn, self.pids = conn, pids
        self.pidfds = {os.pidfd_open(pid): pid for pid in pids}
        self.status: dict[int, int] = {}
        self.kill_at: float | None = None

    def reaped(self, pid: int) -> None:
        _, raw = os.waitpid(pid, 0)
        self.status[pid] = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        if self.status[pid] != 0 and self.kill_at is None and len(self.status) < len(self.pids):
            self.signal(signal.SIGTERM)
            self.kill_at = time.monotonic() + STOP_GRACE_S

    def signal(self, number: int) -> None:
        for pid in self.pids:
            if pid not in self.status:
                try:
                    os.kill(pid, number)
                except ProcessLookupError:
                    pass

    def done(self) -> bool:
        return len(self.status) == len(self.pids)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    (length,) = HEADER.unpack(data[:HEADER.size])
    data = data[HEADER.size:]
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return json.loads(data), fds


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    groups: list[Group] = []
    print("ready", flush=True)
    try:
        while True:
            deadlines = [g.kill_at for g in groups if g.kill_at is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in selector.select(timeout):
                if key.data == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return
                elif key.data == "accept":
                    conn, _ = listener.accept()
                    try:
                        request, fds = receive(conn)
                    except (ConnectionError, ValueError, OSError):
                        conn.close()
                        continue
                    out_fd, err_fd = fds
                    open_fds = [listener.fileno(), sys.stdin.fileno(), conn.fileno(), selector.fileno()] + \
                               [fd for g in groups for fd in (*g.pidfds, g.conn.fileno())]
                    pids: list[int] = []
                    for rank in range(len(request["env"])):
                        pid = os.fork()
                        if pid == 0:
                            join_group(pids[0] if pids else 0)
                            run_child(request, rank, out_fd, err_fd, open_fds)
                        join_group(pids[0] if pids else pid, pid)  # (both sides: whichever runs first)
                        pids.append(pid)
                    os.close(out_fd)
                    os.close(err_fd)
                    group = Group(conn, pids)
                    groups.append(group)
                    for pidfd in group.pidfds:
                        selector.register(pidfd, selectors.EVENT_READ, group)
                    conn.sendall((json.dumps({"pgid": pids[0], "pids": pids}) + "\n").encode())
                else:
                    group = key.data
                    selector.unregister(key.fd)
                    group.reaped(group.pidfds[key.fd])
                    os.close(key.fd)
            for group in [g for g in groups if g.kill_at is not None and time.monotonic() >= g.kill_at]:
                group.signal(signal.SIGKILL)
                group.kill_at = None
            for group in [g for g in groups if g.done()]:
                try:
                    group.conn.sendall((json.dumps({"exit": [group.status[pid] for pid in group.pids]}) + "\n").encode())
                except OSError:  # the client gave up (its timeout): nothing to tell
                    pass
                group.conn.close()
                groups.remove(group)
    finally:
        for group in groups:
            group.signal(signal.SIGKILL)
        os.unlink(path)


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
