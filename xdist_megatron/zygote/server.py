"""The zygote: a fork server that imports torch and the heavy packages once, then forks ranks.

Started by its owner as `python -m xdist_megatron.zygote FD OPTIONS_JSON`, with FD one end of
a socket pair and the options `preload`, `standby`, `address`, `cuda`, `careful` and `coverage` (a
measured owner's CoverageTarget: the preloads are measured and published for it); with an address it
also listens on that abstract Unix socket for more drivers (the workers of an xdist run share the
controller's zygote: one import of the heavy packages per host instead of one per worker). It
never initialises CUDA, so its forks can; where the ranks will use CUDA, a preload that touched
the CUDA driver is dropped: the zygote that replaces a spoilt one (`careful`) tries each preload
in a throwaway fork first.
Requests arrive on each driver's socket; the rank ends of the ranks' socket pairs arrive with a
"fork" request as SCM_RIGHTS ancillary data. It reports each rank's exit (code or signal) to its
driver as soon as it reaps it, kills a driver's ranks when that driver goes, and every child when
the owner goes.
It also forks the xdist workers themselves, for `controller/worker_launcher.py`, which stands in for
`python` when execnet starts one: a worker forked here starts with everything imported that the
controller's conftest files made it import, instead of importing it all again, once per worker.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from .. import pycache
from ..coverage import rank_coverage
from ..protocol import (
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
from .child import die_with_zygote, flush_and_exit
from .preload import BASE_PRELOAD, preload
from .worker import run_as_python

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
WARM_POOL = "TORCH_WARM_POOL"
OWNER_POLL = 0.2  # seconds between the checks that the owner is still there


# What a rank's CUDA context depends on, besides its device: set before CUDA initialises.
CUDA_ENV_PREFIXES = ("CUDA_", "PYTORCH_", "NCCL_", "NVIDIA_", "TORCH_")
WarmKey = tuple[int, tuple[tuple[str, str], ...]]  # (local rank, the CUDA environment)
WARM_PER_KEY = 2  # one becomes a rank while the other is still warm: back-to-back gangs

# The worker launcher imports nothing of ours (it must start in milliseconds), so it and the
# zygote speak plain tuples: (FORK_WORKER, cwd, environ, code) with its stdin, stdout and stderr
# as SCM_RIGHTS; ("forked", pid) and ("exited", code) after it.
FORK_WORKER = "fork-worker"
WARMED_UP = b"w"  # a warm standby's word to the zygote: its context and NCCL are set up


def warm_key(spec: Any) -> WarmKey | None:
    """Which warm standby can become the rank of `spec`: one that made the same device current
    under the same CUDA environment; None for a rank without CUDA."""
    if not spec.use_cuda:
        return None
    cuda_env = tuple(sorted((k, v) for k, v in spec.env.items() if k.startswith(CUDA_ENV_PREFIXES)))
    return int(spec.env["LOCAL_RANK"]), cuda_env


@dataclass
class Standby:
    """A rank forked ahead of need, waiting on `control` for its RankSpec and rank socket;
    `warm`: the CUDA context it created already (None: none, any rank can use it)."""

    pid: int
    control: socket.socket
    warm: WarmKey | None = None

    def warmed_up(self) -> bool:
        """A warm standby says so on its control socket once its warm-up is done."""
        return bool(select.select([self.control], [], [], 0)[0])


class Client:
    """One driver's connection: its requests, its ranks' sockets (SCM_RIGHTS), its ranks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.children: set[int] = set()
        self.name: str | None = None  # what a sharing driver calls itself (Join)
        self.ranks: dict[int, tuple[int, int]] = {}  # pid -> (rank, world size), while alive
        self.launcher = False  # a worker launcher's: it speaks plain tuples

    def exited(self, pid: int, code: int) -> None:
        self.send(("exited", code) if self.launcher else RankExited(pid, code))

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
        self,
        fd: int,
        standby_target: int,
        listener: socket.socket | None,
        cuda: bool,
        careful: bool = False,
    ) -> None:
        self.cuda = cuda  # whether the ranks will use CUDA, so forks must keep it usable
        self.careful = careful  # try each preload in a fork first (see preload.preload)
        self.breaks_cuda: list[str] = []  # preloads after which no fork could use a GPU
        self.owner = Client(socket.socket(fileno=fd))
        self.clients = [self.owner]
        self.listener = listener
        self.owner_of: dict[int, Client] = {}  # rank pid -> its driver
        self.children: set[int] = set()  # ranks and standby ranks
        # Forked ahead of need: forking a zygote that holds torch and megatron costs 20-50 ms a
        # process, and a rank's CUDA context 0.2-0.3 s more; a warm standby has made its
        # device current already, for the device and CUDA environment a gang used before.
        self.standby: list[Standby] = []
        self.standby_target = standby_target
        self.warm_wanted: Counter[WarmKey] = Counter()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self) -> None:
        while True:
            idle_work = not self.breaks_cuda and (self._missing_warm() or self._missing_cold())
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
        elif isinstance(request, tuple) and request[0] == FORK_WORKER:
            client.launcher = True
            client.send(self._fork_worker(client, *request[1:]))
        elif isinstance(request, Leave):
            if client is self.owner:
                self._kill(self.children)
                return False
            self._disconnect(client)
        return True

    def preload_for(self, client: Client, modules: list[str]) -> None:
        """Import `modules` for every later fork, and tell `client` how that went. Once a
        preload spoilt CUDA nothing more is imported: a check now would blame the next module."""
        if self.breaks_cuda:
            client.send(Preloaded({}, self.breaks_cuda, os.getpid()))
            return
        failures, breaks_cuda = preload(
            [m for m in modules if m not in sys.modules], self.cuda, self.careful
        )
        rank_coverage.publish()
        # Everything imported so far lives as long as every rank: keep it out of every later
        # gc.collect() (the per-test cleanup collects) and out of copy-on-write faults.
        gc.collect()
        gc.freeze()
        if breaks_cuda:  # ranks running now are unharmed; no later fork is made
            self.breaks_cuda += breaks_cuda
            self._kill({standby.pid for standby in self.standby})
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
        keys = [warm_key(spec) for spec in specs]
        # The same gang, replaced, or the next of its kind, may come at once: keep two warm.
        wanted = Counter(key for key in keys if key is not None)
        self.warm_wanted |= Counter({key: WARM_PER_KEY * count for key, count in wanted.items()})
        pids = []
        for spec, key, fd in zip(specs, keys, fds, strict=True):
            standby = self._take_standby(key)
            if standby is not None:
                pid = standby.pid
                socket.send_fds(standby.control, [pickle.dumps(spec)], [fd])
                standby.control.close()
            else:
                pid = os.fork()
                if pid == 0:
                    self._become_rank(lambda spec=spec, fd=fd: (spec, fd))
            os.close(fd)
            self._adopt(client, pid)
            client.ranks[pid] = (spec.rank, spec.world_size)
            pids.append(pid)
        return Forked(pids)

    def _fork_worker(
        self, client: Client, cwd: str, environ: dict[str, str], code: str
    ) -> tuple[str, object]:
        """An xdist worker, forked onto the launcher's stdin, stdout and stderr; it is the
        launcher's child as a rank is its driver's (killed when the launcher goes)."""
        _, fds, _, _ = socket.recv_fds(client.sock, 1, 3)
        if self.breaks_cuda or len(fds) != 3:  # the worker could not use CUDA: it starts anew
            for fd in fds:
                os.close(fd)
            return ("refused", self.breaks_cuda)
        pid = os.fork()
        if pid == 0:
            self._become_worker(cwd, environ, code, fds)
        for fd in fds:
            os.close(fd)
        self._adopt(client, pid)
        return ("forked", pid)

    def _adopt(self, client: Client, pid: int) -> None:
        """A child forked for `client`: reaped here, reported to it, killed when it goes."""
        self.children.add(pid)
        client.children.add(pid)
        self.owner_of[pid] = client

    def _take_standby(self, key: WarmKey | None) -> Standby | None:
        """For `key`: a standby warm for it (one done warming up first), else a cold one; a
        standby warm for another key made another device current and cannot serve."""
        choices = [s for s in self.standby if s.warm is None]
        if key is not None:
            warm = [s for s in self.standby if s.warm == key]
            choices = sorted(warm, key=lambda standby: not standby.warmed_up()) + choices
        if not choices:
            return None
        self.standby.remove(choices[0])
        return choices[0]

    def _missing_warm(self) -> list[WarmKey]:
        """The warm standbys the gangs so far would want, and the pool lacks."""
        have = Counter(standby.warm for standby in self.standby)
        return list((self.warm_wanted - have).elements())

    def _missing_cold(self) -> bool:
        """Whether the pool has fewer cold standbys than its target leaves beside the warm."""
        cold = sum(standby.warm is None for standby in self.standby)
        return cold < self.standby_target - sum(self.warm_wanted.values())

    def _add_standby(self) -> None:
        """Fork one standby while idle: a missing warm one first, then a cold one."""
        missing = self._missing_warm()
        warm = missing[0] if missing else None
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._become_rank(lambda: _await_assignment(theirs, warm))
        theirs.close()
        self.children.add(pid)
        self.standby.append(Standby(pid, ours, warm))

    def _become_rank(self, assignment: Any) -> None:
        """In the child: drop the zygote's resources, wait for the rank's spec if this is a
        standby, and run the rank; never returns."""
        code = 1
        try:
            die_with_zygote()
            self._drop_resources()
            from ..ranks.rank import run_rank

            spec, fd = assignment()
            code = run_rank(spec, fd)
        except BaseException:
            traceback.print_exc()
        finally:
            flush_and_exit(code)

    def _become_worker(self, cwd: str, environ: dict[str, str], code: str, fds: list[int]) -> None:
        """In the child: drop the zygote's resources and run `code` as `python -u -c code`
        would have, in the launcher's directory and environment; never returns. A worker is
        no rank: it outlives this zygote (its gangs then come from a zygote of its own)."""
        exit_code = 1
        try:
            self._drop_resources()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            exit_code = run_as_python(cwd, environ, code)
        except BaseException:
            traceback.print_exc()
        finally:
            flush_and_exit(exit_code)

    def _drop_resources(self) -> None:
        """In a child: what is the zygote's alone (its signal wake-up, sockets and pipes, its
        process group: the child leads one of its own, which its own children join)."""
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for own in (self.wake_r, self.wake_w):
            os.close(own)
        for standby in self.standby:
            standby.control.close()
        for client in self.clients:
            client.close()
        if self.listener is not None:
            self.listener.close()

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
            _end_process_group(pid)
            for standby in [s for s in self.standby if s.pid == pid]:
                self.standby.remove(standby)
                if standby.warm is not None:  # it could not warm up: stop trying that one
                    del self.warm_wanted[standby.warm]
            client = self.owner_of.pop(pid, None)
            if client is not None:
                client.children.discard(pid)
                client.ranks.pop(pid, None)
                client.exited(pid, code)
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


def _await_assignment(control: socket.socket, warm: WarmKey | None) -> tuple[Any, int]:
    """A standby's wait for its rank: (RankSpec, rank socket fd); exit when the zygote goes.
    A warm one first creates its CUDA context, under the environment its ranks will have."""
    if warm is not None:
        _warm_up(*warm)
        with contextlib.suppress(OSError):  # taken while warming: its spec is on the way
            control.send(WARMED_UP)
    message, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
    if not message or not fds:
        os._exit(0)
    control.close()
    return pickle.loads(message), fds[0]


def _warm_up(local_rank: int, cuda_env: tuple[tuple[str, str], ...]) -> None:
    """What a GPU rank pays before its first collective, paid ahead: its CUDA context, and
    NCCL's once-per-process set-up (through a communicator of one, destroyed at once)."""
    os.environ.update(cuda_env)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    tensor = torch.ones(1, device="cuda")
    if dist.is_nccl_available():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        dist.destroy_process_group()


def _end_process_group(leader: int) -> None:
    """What a child that has ended left in its process group: the processes its tests started
    and did not end, which a rank killed by a signal (a crash, a hang) never could."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def _exit_with_owner(children: Callable[[], set[int]]) -> None:
    """The owner's socket is read only between imports, and importing megatron.core takes tens
    of seconds on a loaded host: an owner killed meanwhile (SIGKILL, or a second Ctrl-C cutting
    its cleanup short) must not leave the zygote importing on. A thread ends the zygote as soon
    as the owner is gone (this process re-parented), and first the process groups of its
    `children`: its ranks would die with it (PR_SET_PDEATHSIG), but not what their tests started.
    Forks carry only the forking thread, so ranks have none."""
    owner = os.getppid()

    def watch() -> None:
        while os.getppid() == owner:
            time.sleep(OWNER_POLL)
        for leader in set(children()):
            _end_process_group(leader)
        os._exit(1)

    threading.Thread(target=watch, name="xdist-megatron-owner", daemon=True).start()


def main(argv: list[str]) -> int:
    zygote: Zygote | None = None
    _exit_with_owner(lambda: zygote.children if zygote is not None else set())
    fd = int(argv[1])
    options = json.loads(argv[2])
    # Compile as the driver does: where it shares a bytecode folder (driver/bytecode.py), its
    # ranks and workers, forked from here, read and write it too.
    pycache.apply(options["bytecode"])
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
    zygote = Zygote(
        fd, options["standby"], listener, options["cuda"], options.get("careful", False)
    )
    zygote.preload_for(zygote.owner, modules)  # one that breaks CUDA: the owner starts another
    zygote.serve()
    return 0
