"""The driver's side of a gang: start it from the zygote, run jobs on it, time out, retire it.

A gang is N rank processes forked from the zygote, joined in a process group through a TCPStore
that the driver owns (port 0, so ports never race). Each rank talks to the driver over its own
socket pair. A job that fails on any rank, times out or loses a rank retires the gang; a `run`
function that raises where every rank finished does not (an ordinary failure, as under torchrun).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from .. import placement
from ..coverage import rank_coverage
from ..devices import detect_devices
from ..protocol import (
    DEVICE_COUNT_VAR,
    DEVICES_VAR,
    DIED,
    FAILED,
    LOCALHOST,
    PASSED,
    STUCK,
    WAITED,
    AtFinishLine,
    CallJob,
    Job,
    PhaseReport,
    RankResult,
    RankSpec,
    Ready,
    ShutdownJob,
    TestJob,
    describe_exit,
)
from ..ranks.capture import output_paths
from ..ranks.rank import STACK_SIGNAL
from . import stacks as stacks_
from .preload import ALWAYS_PRELOAD
from .timeouts import DEFAULT_TIMEOUT
from .zygote_client import ZygoteClient, ZygoteError

START_TIMEOUT = 120.0
FAILURE_GRACE = 2.0  # how long the other ranks may still finish after one rank failed
STACK_WAIT = 2.0


class GangError(RuntimeError):
    """A gang could not start, or a call failed on some of its ranks."""

    def __init__(self, message: str, results: list[RankResult] | None = None) -> None:
        super().__init__(message)
        self.results = results or []


class Gang:
    """N ranks in a process group, ready to run jobs.

    Standalone use: `with Gang(world_size=2) as g: g.run(fn, 1, 2)`.
    """

    def __init__(
        self,
        world_size: int,
        devices: placement.DeviceSet | None = None,
        block: tuple[int, ...] | None = None,
        backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        zygote: ZygoteClient | None = None,
        workdir: str | None = None,
        gangs_at_once: int = 1,
    ) -> None:
        """`gangs_at_once`: how many gangs may run on this host at once, this one included (xdist
        workers side by side): they share its cores."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.devices = devices or detect_devices()
        self.block = block or placement.block_for(self.devices, world_size)
        if self.block is None:
            raise GangError(f"needs {world_size} devices, {self.devices.count} available")
        self.backend = backend or default_backend(self.devices)
        self.timeout = timeout
        self.gangs_at_once = gangs_at_once
        self._own_zygote = zygote is None
        self._own_workdir: str | None = None
        self._zygote = zygote
        self._workdir = workdir
        self.pids: list[int] = []
        self.last_module: str | None = None
        self._conns: list[Connection] = []
        self._store: Any = None
        self.alive = False

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> Gang:
        """Fork the ranks and wait until every one has joined the process group."""
        import torch.distributed as dist

        if self._zygote is None:
            self._zygote = ZygoteClient(list(ALWAYS_PRELOAD), None, cuda=self.devices.is_cuda)
        if self._workdir is None:
            self._workdir = self._own_workdir = tempfile.mkdtemp(prefix="xdist-megatron-gang-")
        self._store = dist.TCPStore(
            LOCALHOST, 0, None, True, timedelta(seconds=START_TIMEOUT), wait_for_workers=False
        )
        specs = [self._spec(rank, self._store.port) for rank in range(self.world_size)]
        pairs = [socket.socketpair() for _ in specs]
        try:
            self.pids = self._zygote.fork(specs, [theirs.fileno() for _, theirs in pairs])
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            self._store = None
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
        self._conns = [Connection(ours.detach()) for ours, _ in pairs]
        self.alive = True
        try:
            self._await_ready()
        except BaseException:
            self.retire()
            raise
        return self

    def _stack_path(self, port: int, rank: int) -> str:
        return os.path.join(self._workdir, f"stacks-{port}-{rank}.txt")

    def _spec(self, rank: int, port: int) -> RankSpec:
        env = {
            **os.environ,  # the ranks see the driver's environment, as torchrun's would
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": LOCALHOST,
            "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": self.devices.visible_devices(self.block),
            DEVICES_VAR: ",".join(str(d) for d in self.block),
            # As torchrun's agent store: MASTER_PORT is a live store ranks join as clients, so a
            # test can destroy the default group and initialise it again from the environment.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            DEVICE_COUNT_VAR: str(self.devices.count),
        }
        return RankSpec(
            rank=rank,
            world_size=self.world_size,
            env=env,
            backend=self.backend,
            store_host=LOCALHOST,
            store_port=port,
            use_cuda=self.devices.is_cuda,
            driver_pid=os.getpid(),
            stack_path=self._stack_path(port, rank),
            start_timeout=START_TIMEOUT,
            coverage=rank_coverage.driver_target(),
            threads=self._threads(),
        )

    def _threads(self) -> int | None:
        """torchrun's rule, N ranks on a host get one thread each unless OMP_NUM_THREADS says
        otherwise, extended to gangs side by side: a lone rank gets its share of the cores, not
        all of them (eight ranks of 16 threads each would oversubscribe 16 cores)."""
        import torch

        if "OMP_NUM_THREADS" in os.environ:
            return None
        if self.world_size > 1:
            return 1
        if self.gangs_at_once > 1:
            return max(1, torch.get_num_threads() // self.gangs_at_once)
        return None

    def _await_ready(self) -> None:
        waiting = dict(zip(self._conns, range(self.world_size), strict=True))
        deadline = time.monotonic() + START_TIMEOUT
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(waiting.values())
                stacks = self._dump_stacks(ranks)
                raise GangError(
                    f"gang of {self.world_size} did not start within {START_TIMEOUT:.0f} s: "
                    f"rank(s) {_ranks(ranks)} never joined the process group\n"
                    + "\n".join(stacks_.render(r, stacks[r], None) for r in ranks)
                )
            for conn in wait(list(waiting), min(remaining, 0.5)):
                rank = waiting.pop(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    code = self._zygote.exit_code(self.pids[rank], 1.0)
                    raise GangError(
                        f"gang of {self.world_size} failed to start: rank {rank} "
                        f"{describe_exit(code)}"
                    ) from None
                if not isinstance(message, Ready):
                    raise GangError(f"rank {rank} sent {message!r} instead of Ready")

    def lost_ranks(self) -> list[int]:
        """Ranks that died while the gang was idle (read from the zygote's exit notices)."""
        self._pump_zygote()
        return [rank for rank, pid in enumerate(self.pids) if self._zygote.exited(pid)]

    def retire(self) -> None:
        """Kill every rank now (after a failure, a timeout or an interrupt)."""
        if not self.alive:
            return
        self.alive = False
        self._zygote.signal(self.pids, signal.SIGKILL)
        self._zygote.wait_exits(self.pids, 5.0)
        self._release()

    def _retire_on_the_way_out(self) -> None:
        """Retire while an error leaves: a zygote already gone (an interrupt's handler killed it,
        and its ranks with it) must not put a ZygoteError in place of that KeyboardInterrupt."""
        with contextlib.suppress(ZygoteError):
            self.retire()

    def close(self) -> None:
        """Shut down cleanly: each rank leaves the process group and exits."""
        if self.alive:
            self.alive = False
            for conn in self._conns:
                try:
                    conn.send(ShutdownJob())
                except OSError:
                    pass
            self._zygote.wait_exits(self.pids, 5.0)
            self._zygote.signal(self.pids, signal.SIGKILL)
            self._zygote.wait_exits(self.pids, 5.0)
            self._release()
        if self._own_zygote and self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._own_workdir is not None:
            shutil.rmtree(self._own_workdir, ignore_errors=True)
            self._own_workdir = self._workdir = None

    def _release(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._store = None

    def __enter__(self) -> Gang:
        try:
            return self.start()
        except BaseException:
            self.close()  # the zygote and folder this gang owns must not outlive it
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- jobs ---------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the per-rank values in rank order."""
        __tracebackhide__ = True
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"gang.run needs an importable function (module level or a functools.partial "
                f"of one) and picklable arguments: {exc}"
            ) from exc
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        results = self.execute(CallJob(payload, list(sys.path), main_path), self.timeout)
        failed = sorted((r for r in results if r.outcome != PASSED), key=lambda r: bool(r.lost))
        if failed:  # the ranks that raised first: the others were stuck waiting for them
            details = "\n".join(rank_failure(r) for r in failed)
            raise GangError(
                f"{getattr(fn, '__name__', fn)} failed on rank(s) "
                f"{_ranks(sorted(r.rank for r in failed))}: {failed[0].message}\n{details}",
                results,
            )
        return [r.value for r in results]

    def execute(self, job: Job, timeout: float) -> list[RankResult]:
        """Send `job` to every rank and collect one result per rank, in rank order.

        Never hangs: a rank that dies is reported with its exit code, ranks still busy at the
        timeout (or shortly after another rank failed) are reported with their Python stacks.
        Any failure retires the gang, but a `run` function that raised on ranks that all
        finished (its CUDA work done): an ordinary failure. Under pytest the cleanup after the
        test then checks the gang's health.
        """
        if not self.alive:
            raise GangError("the gang is not running")
        try:
            payload = pickle.dumps(job)
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError:  # a rank died between jobs
            self._pump_zygote()
            results = [self._death(rank) for rank in range(self.world_size)]
            self.retire()
            return results
        try:
            results = self._collect(timeout, _test_frame(job))
        except BaseException:
            self._retire_on_the_way_out()
            raise
        if any(r.outcome == FAILED for r in results):
            self.retire()
        return results

    def _collect(self, timeout: float, test: stacks_.TestFrame | None) -> list[RankResult]:
        reports: dict[int, list[dict]] = {rank: [] for rank in range(self.world_size)}
        results: dict[int, RankResult] = {}
        finished: set[int] = set()  # ranks done with their test, waiting for their peers
        waiting = dict(zip(self._conns, range(self.world_size), strict=True))
        start = time.monotonic()
        deadline = start + timeout
        grace_end = float("inf")
        while waiting:
            now = time.monotonic()
            limit = min(deadline, grace_end)
            if now >= limit:
                break
            for conn in wait([*waiting, self._zygote.conn], min(limit - now, 1.0)):
                if conn is self._zygote.conn:
                    self._pump_zygote()
                    continue
                rank = waiting[conn]
                if self._take(conn, rank, reports, finished, results):
                    del waiting[conn]
            for conn, rank in list(waiting.items()):
                if self._zygote.exited(self.pids[rank]):
                    while conn.poll(0) and not self._take(conn, rank, reports, finished, results):
                        pass  # what it sent before it died still counts
                    del waiting[conn]
                    results.setdefault(rank, self._death(rank))
            if grace_end == float("inf") and _cause(results, reports, finished) is not None:
                grace_end = time.monotonic() + FAILURE_GRACE
        if waiting:
            ranks = sorted(waiting.values())
            self._report_unfinished(ranks, results, reports, finished, timeout, test)
        for rank, result in results.items():
            result.reports = reports[rank]
            if result.lost:
                result.duration = time.monotonic() - start
        return [results[rank] for rank in range(self.world_size)]

    def _take(
        self,
        conn: Connection,
        rank: int,
        reports: dict[int, list[dict]],
        finished: set[int],
        results: dict[int, RankResult],
    ) -> bool:
        """Read one message of `rank`; True once it is the rank's final result (or death)."""
        message = self._receive(conn, rank)
        if isinstance(message, PhaseReport):
            reports[rank].append(message.data)
            return False
        if isinstance(message, AtFinishLine):
            finished.add(rank)
            return False
        results[rank] = message
        return True

    def _report_unfinished(
        self,
        ranks: list[int],
        results: dict[int, RankResult],
        reports: dict[int, list[dict]],
        finished: set[int],
        timeout: float,
        test: stacks_.TestFrame | None,
    ) -> None:
        """Ranks still busy in their test fail with their stacks; a rank that was done and only
        waited for its peers says so, and its own reports stand."""
        cause = _cause(results, reports, finished)
        stacks = self._dump_stacks(ranks)
        for rank in ranks:
            if rank in finished:
                message = f"rank {rank} was done and waited for its peers"
                results[rank] = RankResult(rank, FAILED, message, lost=WAITED)
            else:
                call = stacks_.innermost_call(stacks[rank])
                message = f"rank {rank} {_why_stuck(call, cause, timeout)}"
                shown = stacks_.render(rank, stacks[rank], test)
                results[rank] = RankResult(rank, FAILED, message, shown, lost=STUCK)

    def _pump_zygote(self) -> None:
        try:
            self._zygote.pump()
        except ZygoteError:
            self._zygote.assume_killed(self.pids)

    def _receive(self, conn: Connection, rank: int) -> RankResult:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return self._death(rank)

    def _death(self, rank: int) -> RankResult:
        code = self._zygote.exit_code(self.pids[rank], 1.0) if self._zygote.alive else None
        message = f"rank {rank} {describe_exit(code)}"
        stdout, stderr = (_read_text(p) for p in output_paths(self._workdir, self.pids[rank]))
        return RankResult(rank, FAILED, message, message, stdout=stdout, stderr=stderr, lost=DIED)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, list[stacks_.Thread]]:
        """Every given rank's Python stacks, through faulthandler (works inside a collective)."""
        paths = {r: self._stack_path(self._store.port, r) for r in ranks}
        self._zygote.signal([self.pids[r] for r in ranks], STACK_SIGNAL)
        deadline = time.monotonic() + STACK_WAIT
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = {r: _size(p) for r, p in paths.items()}
            if all(now.values()) and now == sizes:
                break
            sizes = now
        return {r: stacks_.parse(_read_text(p)) for r, p in paths.items()}


def _why_stuck(call: str | None, cause: int | None, timeout: float) -> str:
    """`timed out after 5 s in all_reduce`, or `was still in barrier 2 s after rank 1 failed`."""
    if cause is not None:
        where = f"in {call}" if call else "running"
        return f"was still {where} {FAILURE_GRACE:g} s after rank {cause} failed"
    return f"timed out after {timeout:g} s" + (f" in {call}" if call else "")


def _test_frame(job: Job) -> stacks_.TestFrame | None:
    if isinstance(job, TestJob):
        return stacks_.TestFrame.of(job.nodeid, job.module_path)
    return None


def _stopped_early(report: dict) -> bool:
    """A setup or call that did not pass: its peers may wait for it in a collective forever."""
    return report.get("when") != "teardown" and report.get("outcome") != "passed"


def _cause(
    results: dict[int, RankResult], reports: dict[int, list[dict]], finished: set[int]
) -> int | None:
    """The lowest rank that died, or that is done with a test that failed, skipped or xfailed:
    once there is one, ranks still running have FAILURE_GRACE seconds to finish."""
    died = [rank for rank, result in results.items() if result.lost == DIED]
    done = [rank for rank in finished if any(_stopped_early(d) for d in reports[rank])]
    done += [r for r, result in results.items() if result.outcome != PASSED and not result.lost]
    return min(died + done, default=None)


def retire_cause(results: list[RankResult]) -> str:
    """Why a job that failed retired its gang, in a few words for the run report: what went
    wrong first (ranks still running after a peer stopped early are its effect, no timeout)."""
    lost = {r.lost for r in results}
    if DIED in lost:
        return "a rank died"
    if STUCK not in lost:
        return "a rank failed its checks"
    first = next((stop for r in results if r.lost != STUCK for stop in _early_stops(r)), None)
    if first is None:
        return "timeout"
    exited = first.startswith(SystemExit.__name__)  # sys.exit: pytest reports it as a failure
    return "a rank exited" if exited else "peers stuck after a failure"


def _early_stops(result: RankResult) -> list[str]:
    """What ended a rank's test early, one line each: a setup or call that did not pass, or a
    failure of the rank's own job."""
    stops = [_crash_message(d) for d in result.reports if _stopped_early(d)]
    if result.outcome != PASSED and not result.lost:
        stops.append(result.message)
    return stops


def _crash_message(report: dict) -> str:
    """The exception line of a serialised report (pytest's `reprcrash`), else its text."""
    longrepr = report.get("longrepr")
    crash = longrepr.get("reprcrash") if isinstance(longrepr, dict) else None
    return crash["message"] if crash else str(longrepr)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def rank_failure(result: RankResult) -> str:
    """One rank's part of a `run` failure: what happened, then its traceback or stacks."""
    shown = result.longrepr if result.longrepr not in (None, result.message) else ""
    return f"--- rank {result.rank}: {result.message} ---\n{shown}".rstrip()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def default_backend(devices: placement.DeviceSet) -> str:
    return "cpu:gloo,cuda:nccl" if devices.is_cuda else "gloo"
