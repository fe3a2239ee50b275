"""The zygote: a fork server that imports torch and the heavy packages once, then forks ranks.

Started by its owner as `python -m xdist_megatron.zygote FD OPTIONS_JSON`, with FD one end of a
socket pair and the options `preload`, `standby`, `address`, `cuda` and `coverage` (a measured
owner's CoverageTarget: the preloads are measured and published for it); with an address it also
listens on that abstract Unix socket for more drivers (the workers of an xdist run share the
controller's zygote: one import of the heavy packages per host instead of one per worker). It
never initialises CUDA, so its forks can; where the ranks will use CUDA, a preload that touched
the CUDA driver is dropped.
Requests arrive on each driver's socket; the rank ends of the ranks' socket pairs arrive with a
"fork" request as SCM_RIGHTS ancillary data. It reports each rank's exit (code or signal) to its
driver as soon as it reaps it, kills a driver's ranks when that driver goes, and every child when
the owner goes.
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
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any

from . import rank_coverage
from .protocol import (
    ZYGOTE_VAR,
    CoverageTarget,
    DriverLeft,
    Forked,
    ForkRanks,
    Join,
    Leave,
    Preload,
    Preloaded,
    RankEnd,
    RankExited,
    SignalRanks,
)

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
WARM_POOL = "TORCH_WARM_POOL"
PR_SET_PDEATHSIG = 1
OWNER_POLL = 0.2  # seconds between the checks that the owner is still there

# What every rank needs, imported once here instead of once per rank.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "pytest",
    "_pytest._code",
    "_pytest.assertion.rewrite",
    "xdist_megatron.rank",
    "xdist_megatron.state",
    "xdist_megatron.rank_session",
    "_pytest.config",
    "_pytest.main",
    "_pytest.python",
    "_pytest.fixtures",
    "_pytest.runner",
)


def preload(modules: list[str], cuda: bool) -> tuple[dict[str, str], list[str]]:
    """Import each module; return ({name: error} for those that failed, [the module that, where
    the ranks will use CUDA, made forking unsafe for it]); the imports stop at such a module."""
    failures: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a broken optional package must not stop the zygote
            failures[name] = f"{type(exc).__name__}: {exc}"
            continue
        if cuda and not _fork_keeps_cuda_usable():
            failures[name] = "initialised CUDA at import; forked ranks could not use the GPU"
            return failures, [name]
    return failures, []


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


class Client:
    """One driver's connection: its requests, its ranks' sockets (SCM_RIGHTS), its ranks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.children: set[int] = set()
        self.name: str | None = None  # what a sharing driver calls itself (Join)
        self.ranks: dict[int, tuple[int, int]] = {}  # pid -> (rank, world size), while alive

    def send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the driver is gone; its EOF is handled in the request loop
            pass

    def close(self) -> None:
        self.conn.close()
        self.sock.close()


class Zygote:
    """The request loop: fork, signal and reap ranks on behalf of its drivers.

    The owner (the process that started the zygote) is connected through the inherited socket;
    with a listening socket, more drivers connect (the workers of one xdist run share the
    controller's zygote). A driver that disconnects takes its ranks with it; the owner, all."""

    def __init__(
        self, fd: int, standby_target: int, listener: socket.socket | None, cuda: bool
    ) -> None:
        self.cuda = cuda  # whether the ranks will use CUDA, so forks must keep it usable
        self.breaks_cuda: list[str] = []  # preloads after which no fork could use a GPU
        self.owner = Client(socket.socket(fileno=fd))
        self.clients = [self.owner]
        self.listener = listener
        self.owner_of: dict[int, Client] = {}  # rank pid -> its driver
        self.children: set[int] = set()  # ranks and standby ranks
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
            idle_work = len(self.standby) < self.standby_target and not self.breaks_cuda
            sources: list[Any] = [c.conn for c in self.clients] + [self.wake_r]
            if self.listener is not None:
                sources.append(self.listener)
            ready = wait(sources, 0 if idle_work else None)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self._reap()
            if self.listener is not None and self.listener in ready:
                self.clients.append(Client(self.listener.accept()[0]))
            for client in [c for c in self.clients if c.conn in ready]:
                if not self._handle_request(client):
                    return
            if not ready:
                self._add_standby()

    def _handle_request(self, client: Client) -> bool:
        """Serve one request; False once the zygote must stop."""
        try:
            request = client.conn.recv()
        except (EOFError, OSError):
            request = Leave()
        if isinstance(request, ForkRanks):
            client.send(self._fork(client, request.specs))
        elif isinstance(request, SignalRanks):
            for pid in request.pids:
                if pid in client.children:
                    os.kill(pid, request.signum)
        elif isinstance(request, Preload):
            self.standby_target = max(self.standby_target, request.standby)
            self.preload_for(client, request.modules)
        elif isinstance(request, Join):
            client.name = request.name
        elif isinstance(request, Leave):
            if client is self.owner:
                self._kill(self.children)
                return False
            self._disconnect(client)
        return True

    def preload_for(self, client: Client, modules: list[str]) -> None:
        """Import `modules` for every later fork, and tell `client` how that went."""
        failures, breaks_cuda = preload([m for m in modules if m not in sys.modules], self.cuda)
        rank_coverage.publish()
        # Everything imported so far lives as long as every rank: keep it out of every later
        # gc.collect() (the per-test cleanup collects) and out of copy-on-write faults.
        gc.collect()
        gc.freeze()
        if breaks_cuda:  # ranks running now are unharmed; no later fork is made
            self.breaks_cuda += breaks_cuda
            self._kill({pid for pid, _ in self.standby})
        client.send(Preloaded(failures, breaks_cuda, os.getpid()))

    def _disconnect(self, client: Client) -> None:
        """A driver left: end its ranks; if it had any and a name, tell the owner how they
        ended (the driver crashed: it can report nothing itself)."""
        ranks = {pid: client.ranks[pid] for pid in client.children if pid in client.ranks}
        codes = self._kill(client.children)
        self.clients.remove(client)
        client.close()
        if client.name is not None and ranks:
            ends = [RankEnd(*ranks[pid], code) for pid, code in codes.items() if pid in ranks]
            self.owner.send(DriverLeft(client.name, sorted(ends)))

    def _fork(self, client: Client, specs: list) -> Forked:
        _, fds, _, _ = socket.recv_fds(client.sock, 1, len(specs))
        if self.breaks_cuda:
            for fd in fds:
                os.close(fd)
            return Forked([], self.breaks_cuda)
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
            client.children.add(pid)
            client.ranks[pid] = (spec.rank, spec.world_size)
            self.owner_of[pid] = client
            pids.append(pid)
        return Forked(pids)

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
            for client in self.clients:
                client.close()
            if self.listener is not None:
                self.listener.close()
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

    def _reap(self) -> dict[int, int]:
        """Reap every child that exited; {pid: exit code}."""
        reaped: dict[int, int] = {}
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = reaped[pid] = os.waitstatus_to_exitcode(status)
            self.children.discard(pid)
            self.standby = [(p, c) for p, c in self.standby if p != pid]
            client = self.owner_of.pop(pid, None)
            if client is not None:
                client.children.discard(pid)
                client.ranks.pop(pid, None)
                client.send(RankExited(pid, code))
        return reaped

    def _kill(self, pids: set[int]) -> dict[int, int]:
        """SIGKILL these children and reap them (their drivers learn of each exit); {pid: exit
        code} of those reaped here."""
        targets = set(pids)  # `pids` may be a driver's own set, which reaping empties
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        codes: dict[int, int] = {}
        deadline = time.monotonic() + 5
        while targets & self.children and time.monotonic() < deadline:
            codes.update(self._reap())
            time.sleep(0.01)
        return {pid: code for pid, code in codes.items() if pid in targets}


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


def _exit_with_owner() -> None:
    """The owner's socket is read only between imports, and importing megatron.core takes tens
    of seconds on a loaded host: an owner killed meanwhile (SIGKILL, or a second Ctrl-C cutting
    its cleanup short) must not leave the zygote importing on. A thread ends the zygote as soon
    as the owner is gone (this process re-parented); its ranks die with it (PR_SET_PDEATHSIG).
    Forks carry only the forking thread, so ranks have none."""
    owner = os.getppid()

    def watch() -> None:
        while os.getppid() == owner:
            time.sleep(OWNER_POLL)
        os._exit(1)

    threading.Thread(target=watch, name="xdist-megatron-owner", daemon=True).start()


def main(argv: list[str]) -> int:
    _exit_with_owner()
    fd = int(argv[1])
    options = json.loads(argv[2])
    modules = list(BASE_PRELOAD) + [m for m in options["preload"] if m not in BASE_PRELOAD]
    address = options["address"]
    os.environ[ZYGOTE_VAR] = str(os.getpid())
    # torch.cuda.is_available() through NVML does not touch the CUDA driver, so a package
    # that asks at import time leaves the zygote safe to fork.
    os.environ.setdefault(NVML_CHECK, "1")
    # torch < 2.5 starts a pool of inductor compile workers (processes, and a thread here)
    # when torch._inductor is imported, which megatron.core does: the zygote needs none, and
    # would fork its ranks beside them. A rank that compiles starts them when it first needs them.
    os.environ.setdefault(WARM_POOL, "0")
    # Libraries may leave idle helper threads behind at import; only the forking thread
    # continues in a rank, which is what a fork server relies on.
    warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
    listener = None
    if address is not None:  # other drivers connect here (an abstract Unix socket), and may
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # queue while we import
        listener.bind("\0" + address)
        listener.listen(128)
    coverage = options.get("coverage")
    rank_coverage.measure(CoverageTarget(**coverage) if coverage else None, "zygote")
    zygote = Zygote(fd, options["standby"], listener, options["cuda"])
    zygote.preload_for(zygote.owner, modules)  # one that breaks CUDA: the owner starts another
    zygote.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
