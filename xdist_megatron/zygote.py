"""The zygote: a fork server that imports torch and the heavy packages once, then forks ranks.

Started by the driver as `python -m xdist_megatron.zygote FD PRELOAD_JSON`, with FD one end of a
socket pair. It never initialises CUDA, so its forks can. Requests arrive on FD; the rank ends of
the ranks' socket pairs arrive with a "fork" request as SCM_RIGHTS ancillary data. It reports each
child's exit (code or signal) as soon as it reaps it, and kills every child when the driver goes.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
PR_SET_PDEATHSIG = 1

# What every rank needs, imported once here instead of once per rank.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "pytest",
    "_pytest._code",
    "_pytest.assertion.rewrite",
    "xdist_megatron.rank",
    "xdist_megatron.state",
    "xdist_megatron.importer",
)


def preload(modules: list[str]) -> dict[str, str]:
    """Import each module; return {name: error} for those that failed or made forking unsafe."""
    failures: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a broken optional package must not stop the zygote
            failures[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not _fork_keeps_cuda_usable():
            failures[name] = "initialised CUDA at import; forked ranks could not use the GPU"
            break
    return failures


def _fork_keeps_cuda_usable() -> bool:
    """Whether a child forked now could still initialise CUDA (torch marks it a 'bad fork'
    once the parent touched the CUDA driver, even through a mere device count)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    if torch.cuda.is_initialized():
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


class Zygote:
    """The request loop: fork, signal and reap ranks on behalf of one driver."""

    def __init__(self, fd: int, standby_target: int) -> None:
        self.conn = Connection(fd)
        self.sock = socket.socket(fileno=os.dup(fd))
        self.children: set[int] = set()
        # Forked ahead of need, each waiting on its socket for a RankSpec and its rank socket:
        # forking a zygote that holds torch and megatron costs 20-50 ms a process.
        self.standby: list[tuple[int, socket.socket]] = []
        self.standby_target = standby_target
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self) -> None:
        while True:
            idle_work = len(self.standby) < self.standby_target
            ready = wait([self.conn, self.wake_r], 0 if idle_work else None)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self._reap()
            if self.conn in ready and not self._handle_request():
                return
            if not ready:
                self._add_standby()

    def _handle_request(self) -> bool:
        try:
            request = self.conn.recv()
        except (EOFError, OSError):
            self._kill_all(signal.SIGKILL)
            return False
        kind = request[0]
        if kind == "fork":
            self.conn.send(("forked", self._fork(request[1])))
        elif kind == "signal":
            _, pids, signum = request
            for pid in pids:
                if pid in self.children:
                    os.kill(pid, signum)
        elif kind == "exit":
            self._kill_all(signal.SIGKILL)
            return False
        return True

    def _fork(self, specs: list) -> list[int]:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, len(specs))
        self.standby_target = max(self.standby_target, len(specs))
        pids = []
        for spec, fd in zip(specs, fds, strict=True):
            if self.standby:
                pid, control = self.standby.pop()
                socket.send_fds(control, [pickle.dumps(spec)], [fd])
                control.close()
            else:
                pid = os.fork()
                if pid == 0:
                    self._become_rank(lambda spec=spec, fd=fd: (spec, fd))
            os.close(fd)
            self.children.add(pid)
            pids.append(pid)
        return pids

    def _add_standby(self) -> None:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._become_rank(lambda: _await_assignment(theirs))
        theirs.close()
        self.children.add(pid)
        self.standby.append((pid, ours))

    def _become_rank(self, assignment: Any) -> None:
        """In the child: drop the zygote's resources, wait for the rank's spec if this is a
        standby, and run the rank; never returns."""
        code = 1
        try:
            _die_with_zygote()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for own in (self.wake_r, self.wake_w):
                os.close(own)
            for _, control in self.standby:
                control.close()
            self.sock.close()
            self.conn.close()
            from .rank import run_rank

            spec, fd = assignment()
            code = run_rank(spec, fd)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.standby = [(p, c) for p, c in self.standby if p != pid]
            self.conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))

    def _kill_all(self, signum: int) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            self.children.discard(pid)


def _await_assignment(control: socket.socket) -> tuple[Any, int]:
    """A standby's wait for its rank: (RankSpec, rank socket fd); exit when the zygote goes."""
    message, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
    if not message or not fds:
        os._exit(0)
    control.close()
    return pickle.loads(message), fds[0]


def _die_with_zygote() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    modules = list(BASE_PRELOAD) + [m for m in json.loads(argv[2]) if m not in BASE_PRELOAD]
    os.environ["XDIST_MEGATRON_ZYGOTE"] = str(os.getpid())
    # torch.cuda.is_available() through NVML does not touch the CUDA driver, so a package
    # that asks at import time leaves the zygote safe to fork.
    os.environ.setdefault(NVML_CHECK, "1")
    # Libraries may leave idle helper threads behind at import; only the forking thread
    # continues in a rank, which is what a fork server relies on.
    warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
    failures = preload(modules)
    # Everything imported so far lives as long as every rank: keep it out of every later
    # gc.collect() (the per-test cleanup collects) and out of copy-on-write faults.
    gc.collect()
    gc.freeze()
    zygote = Zygote(fd, int(argv[3]) if len(argv) > 3 else 0)
    zygote.conn.send(("ready", failures, os.getpid()))
    if any("CUDA" in reason for reason in failures.values()):
        return 1
    zygote.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
