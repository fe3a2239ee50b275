"""The driver's handle on its zygote: start it, ask it to fork or signal ranks, learn of exits."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import IO, Any

from .. import pycache
from ..coverage import rank_coverage
from ..protocol import (
    DriverLeft,
    ForkRanks,
    Join,
    Leave,
    Preload,
    RankEnd,
    RankExited,
    RankSpec,
    SignalRanks,
)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # xdist_megatron/
HOST_ZYGOTE_LOG = "zygote.log"  # in the session folder: output of the workers' shared zygote
ZYGOTE_START_TIMEOUT = 600.0  # importing megatron + TE cold can take minutes on a loaded CI host


def host_zygote_log(session_dir: str, capture: str) -> str | None:
    """Where the session's shared zygote writes its output: a file of the session folder, or
    the terminal (None) under `--capture=no`."""
    return os.path.join(session_dir, HOST_ZYGOTE_LOG) if capture != "no" else None


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


class ForkRefused(ZygoteError):
    """The zygote (a shared one) imported a module that touched CUDA: it forks no more ranks."""


class ZygoteClient:
    """A driver's connection to a zygote: one it started (and owns), or, with `connect`, the one
    another process started and shares (the controller's, for every worker of an xdist run)."""

    def __init__(
        self,
        preload: list[str],
        log: IO[bytes] | None,
        standby: int = 0,
        address: str | None = None,
        cuda: bool = True,
        careful: bool = False,
    ) -> None:
        """Start a zygote; with `address`, it also accepts `connect` from other drivers. `cuda`:
        whether its ranks will use CUDA (only then may a preload not touch the CUDA driver);
        `careful`: it replaces one that a preload spoilt, so it tries each preload first."""
        self.cuda = cuda
        ours, theirs = socket.socketpair()
        coverage = rank_coverage.driver_target()
        options = {
            "preload": preload,
            "standby": standby,
            "address": address,
            "cuda": cuda,
            "careful": careful,
            "coverage": dataclasses.asdict(coverage) if coverage else None,
            "bytecode": pycache.settings(),
        }
        command = [
            sys.executable,
            "-m",
            "xdist_megatron.zygote",
            str(theirs.fileno()),
            json.dumps(options),
        ]
        process = subprocess.Popen(
            command,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=_zygote_env(),
            start_new_session=True,  # the terminal's Ctrl-C goes to the driver, not to the ranks
        )
        theirs.close()
        self._attach(preload, address, ours, process)

    @classmethod
    def connect(cls, address: str, preload: list[str], name: str | None = None) -> ZygoteClient:
        """Join the zygote listening at `address`; it imports what `preload` adds to its own.
        `name` (an xdist worker id): how its owner hears of this driver's ranks, should it die."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + address)
        client = cls.__new__(cls)
        client._attach(preload, address, sock, None)
        if name is not None:
            client.conn.send(Join(name))
        client.add_preload(preload)
        return client

    def add_preload(self, modules: list[str], standby: int = 0) -> None:
        """Have the zygote import these as well (it skips what it has), and keep `standby`
        ranks forked ahead of need; `preload_failures` waits for them too."""
        self.preload = list(dict.fromkeys([*self.preload, *modules]))
        self.conn.send(Preload(modules, standby))
        self._awaited += 1

    def _attach(
        self,
        preload: list[str],
        address: str | None,
        sock: socket.socket,
        process: subprocess.Popen | None,
    ) -> None:
        self.preload = preload
        self.address = address
        self._exits: dict[int, int] = {}
        self.left: dict[str, list[RankEnd]] = {}  # the owner's: named drivers that went away
        self._sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.process = process  # None: a shared zygote, which another process owns
        self.pid = process.pid if process else None  # a shared one's comes with Preloaded
        self._lost = False
        self._failures: dict[str, str] = {}
        self.breaks_cuda: list[str] = []  # preloads that touched CUDA: its forks are unusable
        self._awaited = 1 if process else 0  # Preloaded replies still to come: start, preloads

    @property
    def preload_failures(self) -> dict[str, str]:
        """{module: why} for preloads that failed; waits until the zygote has finished them."""
        while self._awaited:
            ready = self._next_reply(ZYGOTE_START_TIMEOUT, "start")
            self._failures.update(ready.failures)
            self._blame(ready.breaks_cuda)
            self.pid = ready.pid
            self._awaited -= 1
        return self._failures

    def _blame(self, modules: list[str]) -> None:
        """A spoilt zygote names its culprits in every later reply: keep each once."""
        self.breaks_cuda += [m for m in modules if m not in self.breaks_cuda]

    @property
    def alive(self) -> bool:
        if self.process is None:
            return not self._lost
        return self.process.poll() is None

    def fork(self, specs: list[RankSpec], fds: list[int]) -> list[int]:
        """Fork one rank per spec; `fds` are the ranks' ends of their socket pairs."""
        self.preload_failures  # noqa: B018 - the zygote must be ready first
        self.conn.send(ForkRanks(specs))
        socket.send_fds(self._sock, [b"f"], fds)
        reply = self._next_reply(60.0, "fork")
        if reply.breaks_cuda:
            self._blame(reply.breaks_cuda)
            modules = ", ".join(reply.breaks_cuda)
            raise ForkRefused(f"the shared zygote imported {modules}, which initialised CUDA")
        return reply.pids

    def signal(self, pids: list[int], signum: int) -> None:
        """Signal ranks that are still the zygote's children (never a recycled pid)."""
        live = [pid for pid in pids if pid not in self._exits]
        if live and self.alive:
            try:
                self.conn.send(SignalRanks(live, signum))
            except OSError:
                pass

    def exited(self, pid: int) -> bool:
        """Whether the zygote has reported this rank's exit (read so far: see `pump`)."""
        return pid in self._exits

    def reported_exit(self, pid: int) -> int | None:
        """The exit code the zygote reported for this rank (negative: its signal), if it did."""
        return self._exits.get(pid)

    def assume_killed(self, pids: list[int]) -> None:
        """The zygote is gone, and its ranks with it (they die with their parent)."""
        for pid in pids:
            self._exits.setdefault(pid, -signal.SIGKILL)

    def pump(self) -> None:
        """Read every message waiting on the connection (exit notices); none once closed."""
        while not self.conn.closed and self.conn.poll():
            self._read()

    def exit_code(self, pid: int, timeout: float = 0.0) -> int | None:
        """The rank's exit code (negative: killed by that signal), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            if pid in self._exits:
                return self._exits[pid]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.alive:
                return None
            wait([self.conn], remaining)

    def wait_exits(self, pids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pid in pids:
            self.exit_code(pid, max(0.0, deadline - time.monotonic()))

    def ranks_left_with(self, name: str, timeout: float) -> list[RankEnd] | None:
        """The owner's: how the ranks of the sharing driver `name` ended when its connection
        closed, once the zygote has reaped them (up to `timeout` s); None if it did not say."""
        deadline = time.monotonic() + timeout
        try:
            while name not in self.left:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.conn.closed or not wait([self.conn], remaining):
                    return None
                self._read()
        except ZygoteError:
            return None
        return self.left.pop(name)

    def close(self, at_once: bool = False) -> None:
        """Stop the zygote, or leave a shared one; either kills this driver's ranks first.
        `at_once` (Ctrl-C): kill our zygote now rather than ask it to leave, which it reads only
        between imports (tens of seconds for megatron.core on a loaded host); its ranks die
        with it (PR_SET_PDEATHSIG)."""
        self._lost = True  # closed: nothing is alive behind this handle any more
        if self.process is None:
            self.conn.close()
            self._sock.close()
            return
        if at_once and self.alive:
            self.process.kill()
            self.process.wait()
        if self.alive:
            try:
                self.conn.send(Leave())
            except OSError:
                pass
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.conn.close()
        self._sock.close()

    def _next_reply(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ZygoteError(f"the zygote did not answer {what!r} within {timeout:.0f} s")
            if not wait([self.conn], min(remaining, 1.0)):
                if not self.alive:
                    raise ZygoteError(f"the zygote {self._gone()} during {what!r}")
                continue
            message = self._read()
            if not isinstance(message, (RankExited, DriverLeft)):  # notices, not replies
                return message

    def _read(self) -> object:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self._lost = True
            if self.process is not None:
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            raise ZygoteError(f"the zygote {self._gone()}") from None
        if isinstance(message, RankExited):
            self._exits[message.pid] = message.code
        elif isinstance(message, DriverLeft):
            self.left[message.name] = message.ranks
        return message

    def _gone(self) -> str:
        if self.process is None:
            return "closed the connection"
        return f"exited with code {self.process.returncode}"


def spawn(preload: list[str], log: str | None, address: str | None, cuda: bool) -> ZygoteClient:
    """Start a zygote writing its output to `log` (None: to this process's terminal)."""
    with open(log, "ab") if log else contextlib.nullcontext() as output:
        return ZygoteClient(preload, output, address=address, cuda=cuda)


def shared_address() -> str:
    """An abstract Unix socket name, unique to this session, for its workers to connect to."""
    return f"xdist-megatron-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _zygote_env() -> dict[str, str]:
    env = dict(os.environ)
    # The zygote must import this package even when it is run from a source checkout.
    package_root = str(PACKAGE_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return rank_coverage.zygote_env(env)
