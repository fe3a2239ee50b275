"""The rank side of a gang: join the process group, then run the driver's jobs until told to stop.

Runs in a process forked from the zygote. Imports here stay light (torch is already loaded by
the zygote); test modules are imported only when a job needs them.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from ..coverage import rank_coverage
from ..protocol import (
    FAILED,
    PASSED,
    RAISED,
    ZYGOTE_VAR,
    AtFinishLine,
    CallJob,
    CleanupJob,
    Job,
    PhaseReport,
    RankInfo,
    RankResult,
    RankSpec,
    Ready,
    ResetJob,
    ShutdownJob,
    TestJob,
)
from . import agreement
from .capture import FdCapture, capture_prefix

STACK_SIGNAL = signal.SIGUSR1
ENV_RENDEZVOUS_PREFIX = "default_pg/"  # where init_process_group("env://") puts its keys
_WATCH_INTERVAL = 0.5
_CHILD_GRACE = 2.0  # s a rank's exit waits for the non-daemonic children its tests left

_info: RankInfo | None = None
_store: Any = None  # this rank's client of the driver's store
_send: Callable[[Any], None] | None = None  # to the driver
_finish_lines = 0


def rank_info() -> RankInfo:
    """Rank, world size, local rank and device of the calling rank process."""
    if _info is not None:
        return _info
    from .inprocess import torchrun_rank_info

    info = torchrun_rank_info()
    if info is None:
        raise RuntimeError("rank_info() is only available on a rank (inside a gang or torchrun)")
    return info


def run_rank(spec: RankSpec, sock_fd: int) -> int:
    """Body of a forked rank process; returns its exit code."""
    zygote_pid = os.environ[ZYGOTE_VAR]
    _watch_parents(int(zygote_pid), spec.driver_pid)
    # The driver's environment, not the zygote's: a shared zygote was started by another process.
    os.environ.clear()
    os.environ.update(spec.env)
    os.environ[ZYGOTE_VAR] = zygote_pid
    rank_coverage.measure(spec.coverage, f"rank{spec.rank}")
    global _send
    conn = Connection(sock_fd)
    _send = conn.send
    stacks = open(spec.stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    _join_process_group(spec)
    from . import isolation

    startup = isolation.snapshot()
    gc.freeze()  # start-up objects are permanent: keep the per-test gc.collect() cheap
    conn.send(Ready(spec.rank, os.getpid()))
    workdir = os.path.dirname(spec.stack_path)
    runner = _JobRunner(spec, startup, capture_prefix(workdir, os.getpid()), conn.send)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            _end_children()
            return 0
        if isinstance(job, ShutdownJob):
            runner.finish()
            _end_children()
            rank_coverage.publish()
            _leave_process_group()
            return 0
        runner.run(job)


def _end_children() -> None:
    """What an interpreter's exit does and this rank's os._exit skips (a torchrun rank exits
    normally): multiprocessing's exit finalizers run (managers and pools shut down), then the
    children its tests left (a background writer, a server) end, the daemonic ones terminated,
    the others after _CHILD_GRACE s of wait (an interpreter would wait for ever; the driver kills
    a rank that takes 5 s)."""
    import multiprocessing
    from multiprocessing import util

    util._run_finalizers(0)  # the exit's own first step (util._exit_function), priority >= 0
    children = multiprocessing.active_children()
    for child in children:
        if child.daemon:
            child.terminate()
    deadline = time.monotonic() + _CHILD_GRACE
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.exitcode is None:
            child.kill()
            child.join(1.0)


def _join_process_group(spec: RankSpec) -> None:
    global _info, _store
    import torch
    import torch.distributed as dist

    if spec.use_cuda:
        local_rank = int(spec.env["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if spec.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        torch.set_num_threads(spec.threads)
    store = dist.TCPStore(
        spec.store_host,
        spec.store_port,
        spec.world_size,
        is_master=False,
        timeout=timedelta(seconds=spec.start_timeout),
    )
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size)
    _info = RankInfo(spec.rank, spec.world_size, int(spec.env["LOCAL_RANK"]), device)
    _store = store


def finish_line(failed: bool) -> bool:
    """Wait until every rank of the gang is done with its test (`agreement.meet`, on the driver's
    store); whether the test failed on any rank. The driver bounds the wait (a peer that never
    comes is hung or dead)."""
    global _finish_lines
    assert _store is not None and _info is not None and _send is not None
    rank_coverage.publish()  # a peer that hangs has the gang killed while this one waits here
    _send(AtFinishLine(_info.rank))  # a peer still running after this one failed is stuck
    _finish_lines += 1
    key = f"xdist-megatron/finished/{_finish_lines}"
    return agreement.meet(_store, key, _info.world_size, failed, timedelta(days=1))


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _watch_parents(zygote_pid: int, driver_pid: int) -> None:
    """Never outlive the zygote or the driver, even while stuck inside a collective (the zygote
    also set PR_SET_PDEATHSIG for this process)."""
    if os.getppid() != zygote_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(_WATCH_INTERVAL)
            if os.getppid() != zygote_pid or not _alive(driver_pid):
                os._exit(1)

    threading.Thread(target=watch, name="xdist-megatron-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _JobRunner:
    """Runs jobs on this rank and keeps what lives between them: its pytest session."""

    def __init__(
        self, spec: RankSpec, startup: Any, capture_prefix: str, send: Callable[[Any], None]
    ) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.capture_prefix = capture_prefix
        self.startup = startup
        self.send = send
        self.session: Any = None  # the rank's pytest session, built on its first test
        self._default_group = _default_group()  # the one the gang made, or the last one seen
        self._restores = 0

    def run(self, job: Job) -> None:
        """Run `job` and send its result (a test's reports were sent as they were made)."""
        start = time.perf_counter()
        if isinstance(job, TestJob) and self.session is None:
            # Outside the test's capture: what plugins say while the session is configured
            # belongs to the rank's log, not to the first test's report.
            opened = self._guarded(lambda: self._open_session(job))
            if opened.outcome == FAILED:
                self.send(opened)
                return
        capture = job.capture if isinstance(job, TestJob) else True
        with FdCapture(capture, self.capture_prefix) as out:
            result = self._dispatch(job)
        result.stdout, result.stderr = out.stdout, out.stderr
        result.duration = time.perf_counter() - start
        result.gpu_used = _gpu_used(int(self.spec.env["LOCAL_RANK"]))
        self.send(result)
        rank_coverage.publish()  # while the driver reads the result: a kill loses one job's lines

    def finish(self) -> None:
        """End of the gang: the session's fixtures and hooks end (errors go to the log)."""
        if self.session is not None:
            try:
                self.session.finish()
            except BaseException:
                traceback.print_exc()

    def _dispatch(self, job: Job) -> RankResult:
        if isinstance(job, TestJob):
            result = self._guarded(lambda: self._run_test(job))
            result.warnings = self.session.take_warnings()
            return result
        if isinstance(job, CallJob):
            return self._run_call(job)
        if isinstance(job, CleanupJob):
            return self._guarded(self._cleanup)
        if isinstance(job, ResetJob):
            return self._guarded(lambda: self._reset(job.next_nodeid))
        raise TypeError(f"unknown job {job!r}")

    def _guarded(self, action: Callable[[], str | None]) -> RankResult:
        try:
            note = action()
        except BaseException as exc:
            return RankResult(self.rank, FAILED, _one_line(exc), traceback.format_exc())
        return RankResult(self.rank, PASSED, note=note or "")

    def _run_test(self, job: TestJob) -> str:
        """The test's protocol in the rank's session, then the checks that keep the gang."""
        self.session.run(job.nodeid, job.module_path, job.next_nodeid)
        return self._keep_fit()

    def _keep_fit(self) -> str:
        """What a test may have left that the next one must not inherit (its own device, a
        working default group), then the health check; what was repaired, for a warning."""
        notes = [self._repin_device(), self._repair_default_group()]
        _check_health()
        return "; ".join(note for note in notes if note)

    def _open_session(self, job: TestJob) -> None:
        from . import isolation
        from .rank_session import RankSession

        self.session = RankSession(job.session, self.rank, self._send_report)
        rank_coverage.follow_tests(self.session.config)
        # Start-up is after the session's own configuration (pytest sets PYTEST_VERSION, say).
        self._in_process_rank().set_startup(isolation.snapshot())

    def _send_report(self, data: dict) -> None:
        self.send(PhaseReport(self.rank, data))

    def _in_process_rank(self) -> Any:
        from .inprocess import PLUGIN_NAME

        if self.session is None:
            return None
        return self.session.config.pluginmanager.get_plugin(PLUGIN_NAME)

    def _cleanup(self) -> str:
        """After a `gang` test: what follows a rank-side test, the checks that keep the gang
        included (its functions may have failed, or left the default group destroyed)."""
        from . import isolation

        plugin = self._in_process_rank()
        if plugin is None:
            isolation.cleanup_after_job()
        else:
            held = plugin.holdings
            isolation.cleanup_after_job(held.groups, keep_libraries=held.megatron)
        return self._keep_fit()

    def _reset(self, next_nodeid: str | None) -> None:
        from . import isolation

        plugin = self._in_process_rank()
        if plugin is None:
            isolation.cleanup_after_job()
            isolation.restore(self.startup)
            return
        self.session.teardown_until(next_nodeid)  # the last module's scopes end
        plugin.reset()

    def _repin_device(self) -> str:
        """A test that left another GPU current (`torch.cuda.set_device`) leaves the next test
        on the rank's own: its tensors, and NCCL's choice of device, would follow the other."""
        if not self.spec.use_cuda:
            return ""
        import torch

        pinned, current = int(self.spec.env["LOCAL_RANK"]), torch.cuda.current_device()
        if current == pinned:
            return ""
        torch.cuda.synchronize(current)  # an error the test caused there surfaces in its test
        torch.cuda.set_device(pinned)
        return f"the test left cuda:{current} current; the gang made it cuda:{pinned} again"

    def _repair_default_group(self) -> str:
        """A test that destroyed the default group, or re-created it with another size, leaves
        the next test a working one of the gang's size (or the gang is retired)."""
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else None
        if world_size == self.spec.world_size:
            if _default_group() is not self._default_group:
                self._forget_rendezvous()
                self._default_group = _default_group()
            return ""
        if world_size is not None:
            dist.destroy_process_group()
        _forget_failed_group_names()
        self._restores += 1
        store = dist.PrefixStore(f"xdist-megatron/restored/{self._restores}", _store)
        dist.init_process_group(
            self.spec.backend, store=store, rank=self.rank, world_size=self.spec.world_size
        )
        self._default_group = _default_group()
        left = "destroyed" if world_size is None else f"re-created with {world_size} ranks"
        return f"the test left the default process group {left}; the gang restored it"

    def _forget_rendezvous(self) -> None:
        """The test initialised the default group again from the environment: drop the keys
        that rendezvous left in the store, so that the next test that does the same does not
        read this one's stale addresses (torch reuses the key names: pytorch#55967)."""
        list_keys = getattr(_store, "list_keys", None)  # torch releases without it keep them
        if self.rank != 0 or list_keys is None:
            return
        for key in list_keys():
            if key.startswith(ENV_RENDEZVOUS_PREFIX):
                _store.delete_key(key)

    def _run_call(self, job: CallJob) -> RankResult:
        """Call the function. It raising is its own outcome and keeps the rank; the rank is not
        fit when the function's CUDA work then fails, or never ends (a peer that raised left a
        collective unmatched: the wait shows this rank stuck, as in a test)."""
        if job.sys_path:
            sys.path[:] = job.sys_path
        try:
            if job.main_path:
                _import_driver_main(job.main_path)
            fn, args, kwargs = pickle.loads(job.payload)
            value = fn(*args, **kwargs)
            pickle.dumps(value)
            result = RankResult(self.rank, PASSED, value=value)
        except (KeyboardInterrupt, SystemExit) as exc:
            return RankResult(self.rank, FAILED, _one_line(exc), traceback.format_exc())
        except BaseException as exc:  # pytest.fail and skip too: the function's own outcome
            result = RankResult(self.rank, RAISED, _one_line(exc), traceback.format_exc())
        try:
            _synchronize_cuda()
        except BaseException as exc:
            return RankResult(self.rank, FAILED, _one_line(exc), traceback.format_exc())
        return result


def _forget_failed_group_names() -> None:
    """Name the next default group as a fresh process would. c10d names groups by a count that
    only destroying a default group resets; a test whose own `init_process_group` failed on this
    rank alone (a peer gone, a timeout) took a name that its peers gave back, and the gang's
    restored group would then wait under another name than theirs, forever."""
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._world.default_pg


def _check_health() -> None:
    """After a test: no CUDA error pending, and the default group still answers."""
    import torch.distributed as dist

    _synchronize_cuda()
    dist.barrier()


def _synchronize_cuda() -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _import_driver_main(path: str) -> None:
    """Make the driver's `__main__` importable here, as multiprocessing's spawn does."""
    if getattr(sys.modules["__main__"], "__file__", None) == path:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)
    # No spec, as in a spawned child: this rank's own spawned children then find the main
    # module by its path (a spec named `__mp_main__` is one they cannot import).
    module.__spec__ = None
    sys.modules["__main__"] = module


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _gpu_used(device: int) -> int:
    """Bytes in use on the GPU by every process (the run report's peak per device); 0 where this
    rank has not initialised CUDA (asking would), or CUDA no longer answers."""
    import torch

    if not torch.cuda.is_initialized():
        return 0
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return 0
    return total - free
