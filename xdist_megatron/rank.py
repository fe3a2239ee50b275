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
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from .capture import FdCapture, capture_prefix
from .protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    CallJob,
    CleanupJob,
    Job,
    RankInfo,
    RankResult,
    RankSpec,
    Ready,
    ResetJob,
    ShutdownJob,
    TestJob,
)
from .zygote import ZYGOTE_VAR

STACK_SIGNAL = signal.SIGUSR1
_WATCH_INTERVAL = 0.5

_info: RankInfo | None = None


def rank_info() -> RankInfo:
    """Rank, world size, local rank and device of the calling rank process."""
    if _info is not None:
        return _info
    from .passthrough import torchrun_rank_info

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
    conn = Connection(sock_fd)
    stacks = open(spec.stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    _join_process_group(spec)
    from . import state

    startup = state.snapshot()
    gc.freeze()  # start-up objects are permanent: keep the per-test gc.collect() cheap
    conn.send(Ready(spec.rank, os.getpid()))
    workdir = os.path.dirname(spec.stack_path)
    runner = _JobRunner(spec.rank, startup, capture_prefix(workdir, os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return 0
        if isinstance(job, ShutdownJob):
            _leave_process_group()
            return 0
        runner.run(job, conn.send)


def _join_process_group(spec: RankSpec) -> None:
    global _info
    import torch
    import torch.distributed as dist

    if spec.use_cuda:
        local_rank = int(spec.env["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if spec.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # What torchrun does: N ranks on one host share its cores.
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
    store = dist.TCPStore(
        spec.store_host,
        spec.store_port,
        spec.world_size,
        is_master=False,
        timeout=timedelta(seconds=spec.start_timeout),
    )
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size)
    _info = RankInfo(spec.rank, spec.world_size, int(spec.env["LOCAL_RANK"]), device)


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
    """Runs jobs on this rank and keeps what lives between them (the open test class)."""

    def __init__(self, rank: int, startup: Any, capture_prefix: str) -> None:
        self.rank = rank
        self.capture_prefix = capture_prefix
        self.startup = startup
        self.open_class: type | None = None
        self.function: Any = None  # the test function being run, to cut tracebacks at it
        self.layout: Any = None  # the Megatron layout kept alive for the next tests

    def run(self, job: Job, send: Any) -> None:
        """Run `job` and send its result. A test whose body did not fail on this rank first
        reports that provisional result, then takes part in the collective cleanup: should a
        peer's failure leave this rank stuck there, the driver still knows its body passed."""
        start = time.perf_counter()
        capture = job.capture if isinstance(job, TestJob) else True
        with FdCapture(capture, self.capture_prefix) as out:
            result = self._dispatch(job)
        result.stdout, result.stderr = out.stdout, out.stderr
        result.duration = time.perf_counter() - start
        if isinstance(job, TestJob) and result.outcome != FAILED:
            result.final = False
            send(result)
            result = self._cleanup_after_test(job, result)
            result.duration = time.perf_counter() - start
        result.final = True
        send(result)

    def _cleanup_after_test(self, job: TestJob, result: RankResult) -> RankResult:
        with FdCapture(job.capture, self.capture_prefix) as out:
            try:
                self._cleanup()
            except BaseException as exc:
                failure = _test_failure(self.rank, exc, job, None)
            else:
                failure = None
        final = failure or result
        final.stdout, final.stderr = result.stdout + out.stdout, result.stderr + out.stderr
        return final

    def _dispatch(self, job: Job) -> RankResult:
        if isinstance(job, TestJob):
            return self._run_test(job)
        if isinstance(job, CallJob):
            return self._run_call(job)
        if isinstance(job, CleanupJob):
            return self._guarded(self._cleanup)
        if isinstance(job, ResetJob):
            return self._guarded(self._reset)
        raise TypeError(f"unknown job {job!r}")

    def _guarded(self, action: Any) -> RankResult:
        try:
            action()
        except BaseException as exc:
            return RankResult(self.rank, FAILED, _one_line(exc), traceback.format_exc())
        return RankResult(self.rank, PASSED)

    def _cleanup(self) -> None:
        from . import state

        state.cleanup_after_job(keep_megatron=self.layout is not None)

    def _reset(self) -> None:
        from . import state

        self._close_class()
        self.layout = None
        state.cleanup_after_job()
        state.restore(self.startup)

    def _run_call(self, job: CallJob) -> RankResult:
        if job.sys_path:
            sys.path[:] = job.sys_path
        try:
            if job.main_path:
                _import_driver_main(job.main_path)
            fn, args, kwargs = pickle.loads(job.payload)
            value = fn(*args, **kwargs)
            pickle.dumps(value)
        except BaseException as exc:
            return RankResult(self.rank, FAILED, _one_line(exc), traceback.format_exc())
        return RankResult(self.rank, PASSED, value=value)

    def _run_test(self, job: TestJob) -> RankResult:
        from _pytest.outcomes import Skipped, XFailed

        from .explain import explaining

        self.function = None
        try:
            with explaining(job.explain):
                self._call_test(job)
        except Skipped as exc:
            return RankResult(self.rank, SKIPPED, exc.msg or "skipped")
        except XFailed as exc:
            return RankResult(self.rank, XFAILED, exc.msg or "xfail")
        except BaseException as exc:
            return _test_failure(self.rank, exc, job, self.function)
        return RankResult(self.rank, PASSED)

    def _call_test(self, job: TestJob) -> None:
        from .importer import import_test_module

        module = import_test_module(job.module_name, job.module_path, job.sys_path)
        self._set_layout(job.layout)
        kwargs = pickle.loads(job.fixtures)
        kwargs.update(_native_values(job.native_names))
        if job.class_path is None:
            self.function = getattr(module, job.function_name)
            self.function(**kwargs)
            return
        cls = _resolve(module, job.class_path)
        self._open(cls)
        instance = cls()
        self.function = getattr(instance, job.function_name)
        _call_xunit(instance, "setup_method", self.function)
        try:
            self.function(**kwargs)
        finally:
            _call_xunit(instance, "teardown_method", self.function)
            if job.teardown_class:
                self._close_class()

    def _set_layout(self, layout: Any) -> None:
        """Bring up the test's Megatron layout, reusing the kept one when it matches."""
        from . import layouts

        kept, self.layout = self.layout, None  # None until done: never keep a half-built state
        self.layout = layouts.switch(layout, kept)

    def _open(self, cls: type) -> None:
        if self.open_class is cls:
            return
        self._close_class()
        _call_xunit(cls, "setup_class")
        self.open_class = cls

    def _close_class(self) -> None:
        cls, self.open_class = self.open_class, None
        if cls is not None:
            _call_xunit(cls, "teardown_class")


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
    sys.modules["__main__"] = module


def _native_values(names: tuple[str, ...]) -> dict[str, Any]:
    info = rank_info()
    values = {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "device": info.device,
    }
    return {name: values[name] for name in names}


def _resolve(module: Any, dotted: str) -> Any:
    target = module
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


def _call_xunit(owner: Any, name: str, *args: Any) -> None:
    """Call an xunit hook if `owner` defines one; like pytest, the argument is optional."""
    hook = getattr(owner, name, None)
    if hook is None:
        return
    import inspect

    try:
        arity = len(inspect.signature(hook).parameters)
    except (TypeError, ValueError):
        arity = len(args)
    if isinstance(owner, type) and not inspect.ismethod(hook):
        hook(owner, *args[: max(arity - 1, 0)])
    else:
        hook(*args[:arity])


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _test_failure(rank: int, exc: BaseException, job: TestJob, function: Any) -> RankResult:
    """A failed test, formatted as pytest formats a local failure, in the run's --tb style."""
    from _pytest._code import Code, ExceptionInfo
    from _pytest.outcomes import Failed

    excinfo = ExceptionInfo.from_exception(exc)
    if function is not None:
        code = Code.from_function(function)
        cut = excinfo.traceback.cut(path=code.path, firstlineno=code.firstlineno)
        if cut:
            excinfo.traceback = cut
    excinfo.traceback = excinfo.traceback.filter(excinfo)
    style = {"auto": "long", "line": "short", "no": "short"}.get(job.tbstyle, job.tbstyle)
    if isinstance(exc, Failed) and not exc.pytrace:
        style = "value"
    try:
        longrepr: Any = excinfo.getrepr(
            style=style, showlocals=job.showlocals, funcargs=True, truncate_locals=True
        )
        crash = longrepr.reprcrash
        message = crash.message if crash is not None else _one_line(exc)
        location = (crash.path, crash.lineno) if crash is not None else None
    except Exception:
        longrepr, message, location = traceback.format_exc(), _one_line(exc), None
    try:
        pickle.dumps(longrepr)
    except Exception:
        longrepr = str(longrepr)
    return RankResult(rank, FAILED, message, longrepr, location)
