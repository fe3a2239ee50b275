"""In the zygote: importing what the ranks will need, once, without leaving the process unfit to
fork ranks that use CUDA (a module that initialises CUDA at import stops the preload there; a
`careful` zygote tries each module in a throwaway fork first)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import time
from typing import NoReturn

from ..protocol import CUDA_AT_IMPORT
from .child import die_with_zygote

CUDA_DRIVER = "libcuda.so.1"
TRIAL_BREAKS_CUDA = 3  # a trial import's exit code: that module initialised CUDA
TRIAL_TIMEOUT = 300.0  # seconds; a trial import that takes longer is left to the ranks
TRIAL_POLL = 0.02  # seconds between looks at the running trials
TRIALS_AT_ONCE = max(1, min(8, len(os.sched_getaffinity(0)) // 2))

# What every rank needs, imported once here instead of once per rank.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "pytest",
    "_pytest._code",
    "_pytest.assertion.rewrite",
    "xdist_megatron.ranks.rank",
    "xdist_megatron.ranks.isolation",
    "xdist_megatron.ranks.rank_session",
    "_pytest.config",
    "_pytest.main",
    "_pytest.python",
    "_pytest.fixtures",
    "_pytest.runner",
)


def preload(
    modules: list[str], cuda: bool, careful: bool = False
) -> tuple[dict[str, str], list[str]]:
    """Import each module; return ({name: error} for those that failed, [the module that, where
    the ranks will use CUDA, made forking unsafe for it]); the imports stop at such a module.
    `careful`: see _preload_carefully."""
    if cuda and careful:
        return _preload_carefully(modules)
    failures: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a broken optional package must not stop the zygote
            failures[name] = f"{type(exc).__name__}: {exc}"
        if cuda and not _fork_keeps_cuda_usable():  # also after an import that raised
            failures[name] = CUDA_AT_IMPORT
            return failures, [name]
    return failures, []


def _preload_carefully(modules: list[str]) -> tuple[dict[str, str], list[str]]:
    """For a zygote that replaces one a preload spoilt: past the base preloads, every module
    and the packages above it are first imported in throwaway forks, those that initialise
    CUDA there are left to the ranks, and the rest imported here, so that one replacement
    serves however many such modules a suite has. Level by level, packages first: a package
    that initialises CUDA leaves every module under it to the ranks untried (most of
    Model-Optimizer's preloads import `modelopt`, which does: one trial each, every one
    importing TE, megatron.core and modelopt), and one that does not is imported here before
    the next level's trials, which then pay only their own imports. A package found is
    reported too, so that the driver remembers it for its modules."""
    failures, breaks_cuda = preload([m for m in modules if m in BASE_PRELOAD], cuda=True)
    pending = [m for m in modules if m not in BASE_PRELOAD]
    depth = 1
    while pending and not breaks_cuda:
        level = list(dict.fromkeys(".".join(m.split(".")[:depth]) for m in pending))
        spoilers = _cuda_initialisers_by_trial(level)
        condemned = [m for m in pending if any(_is_under(m, found) for found in spoilers)]
        failures.update(dict.fromkeys([*sorted(spoilers), *condemned], CUDA_AT_IMPORT))
        safe = [m for m in level if m not in spoilers and m not in sys.modules]
        imported, breaks_cuda = preload(safe, cuda=True)
        failures.update(
            {m: why for m, why in imported.items() if m in modules or why == CUDA_AT_IMPORT}
        )
        if breaks_cuda:  # spared CUDA in its trial, not here: name the preloads it spoils
            breaks_cuda = [m for m in modules if _is_under(m, breaks_cuda[0])]
        pending = [m for m in pending if m.count(".") >= depth and m not in condemned]
        depth += 1
    return failures, breaks_cuda


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cuda_initialisers_by_trial(modules: list[str]) -> set[str]:
    """The modules whose import, in a fork of this process, leaves no fork able to use CUDA
    (or takes over TRIAL_TIMEOUT); tried side by side, TRIALS_AT_ONCE at a time (every xdist
    worker's zygote may be trying at once, each fork importing the suite's stack)."""
    found: set[str] = set()
    pending = [m for m in modules if m not in sys.modules]
    running: dict[int, tuple[str, float]] = {}  # pid -> (module, deadline)
    while pending or running:
        while pending and len(running) < TRIALS_AT_ONCE:
            name = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _exit_after_trial(name)
            running[pid] = name, time.monotonic() + TRIAL_TIMEOUT
        time.sleep(TRIAL_POLL)
        for pid, (name, deadline) in list(running.items()):
            late = time.monotonic() > deadline
            if late:
                os.kill(pid, signal.SIGKILL)
            # this pid only: os.wait() could reap a rank, whose exit its driver must hear of
            done, status = os.waitpid(pid, 0 if late else os.WNOHANG)
            if not done:
                continue
            del running[pid]
            if late or os.waitstatus_to_exitcode(status) == TRIAL_BREAKS_CUDA:
                found.add(name)
    return found


def _exit_after_trial(name: str) -> NoReturn:
    """In a throwaway fork: import `name` and exit saying whether CUDA is still usable after;
    whatever happens, exit (this fork must never go on as a second zygote)."""
    code = TRIAL_BREAKS_CUDA  # unless shown otherwise
    try:
        die_with_zygote()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        with contextlib.suppress(BaseException):  # the real import reports an error
            importlib.import_module(name)
        code = 0 if _fork_keeps_cuda_usable() else TRIAL_BREAKS_CUDA
    finally:
        os._exit(code)


def _fork_keeps_cuda_usable() -> bool:
    """Whether a child forked now could still initialise CUDA (torch marks it a 'bad fork'
    once the parent touched the CUDA driver, even through a mere device count; a C library
    that called cuInit itself only the driver knows of)."""
    if _cuda_driver_initialised():
        return False
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


def _cuda_driver_initialised() -> bool:
    """Whether anything in this process called cuInit: until then the driver answers every
    other call with CUDA_ERROR_NOT_INITIALIZED. False where there is no driver."""
    try:
        driver = ctypes.CDLL(CUDA_DRIVER)
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) == 0  # CUDA_SUCCESS
