"""`torchrun -m pytest --cov=pkg`: one report, rank 0's, of the lines every rank ran.

pytest-cov in each torchrun rank would measure it, combine every data file of the folder and
report: the ranks race (one combines and deletes the files of another, which then warns that they
do not exist) and each prints a report of its own. Here pytest-cov runs on rank 0 only; every
other rank measures itself with pytest-cov's settings, publishes its data into a folder of the
run after each test and at the end of its test loop, then says it is done; rank 0 waits for them
(bounded) and combines their data into its own before pytest-cov reports.

A pytest plugin of its own: its hook must run before pytest-cov's (tryfirst) creates its plugin.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Generator
from typing import Any

import pytest

from ..roles import Role, started_as
from . import rank_coverage

DONE = ".done"
WAIT_FOR_RANKS = 120.0  # seconds rank 0 waits for the others' data after its own test loop
_POLL = 0.1


def _on_torchrun_rank() -> bool:
    return started_as() is Role.TORCHRUN_RANK


def _rank() -> int:
    return int(os.environ["RANK"])


def _store() -> str:
    """The run's folder, beside the data files (shared by the nodes of a multi-node run)."""
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('MASTER_PORT', '')}"
    return os.path.abspath(f".xdist-megatron-torchrun-{run}")


def _measuring(options: Any) -> bool:
    return bool(getattr(options, "cov_source", None)) and not getattr(options, "no_cov", False)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    """On a torchrun rank other than 0: pytest-cov off (its plugin not even registered: a
    disabled one fails `no_cover` tests), this rank measured with its settings instead."""
    options = early_config.known_args_namespace
    if _on_torchrun_rank() and _rank() != 0 and _measuring(options):
        from coverage import Coverage

        options.no_cov = True
        early_config.pluginmanager.set_blocked("_cov")
        sources = None if True in options.cov_source else options.cov_source
        cov = Coverage(source=sources, branch=options.cov_branch, config_file=options.cov_config)
        os.makedirs(_store(), exist_ok=True)
        rank_coverage.measure_with(cov, _store(), f"rank{_rank()}")
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    if _on_torchrun_rank():
        rank_coverage.follow_tests(config)


def pytest_runtest_logfinish() -> None:
    if _on_torchrun_rank():
        rank_coverage.publish()  # a rank that dies later keeps this test's lines


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, None, Any]:
    """Inside pytest-cov's wrapper: the other ranks hand over, rank 0 combines."""
    try:
        return (yield)
    finally:
        if _on_torchrun_rank() and _rank() != 0:
            _hand_over()
        elif _on_torchrun_rank():
            _gather(session.config)


def _hand_over() -> None:
    if rank_coverage.measured():
        rank_coverage.publish()
        open(os.path.join(_store(), f"rank{_rank()}{DONE}"), "w").close()


def _gather(config: pytest.Config) -> None:
    cov = rank_coverage.current()
    if cov is None or not config.pluginmanager.hasplugin("_cov"):
        return
    store = _store()
    others = [f"rank{r}{DONE}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
    deadline = time.monotonic() + WAIT_FOR_RANKS
    while not all(os.path.exists(os.path.join(store, name)) for name in others):
        if time.monotonic() > deadline:
            break  # a rank that died: what it published so far still counts
        time.sleep(_POLL)
    if os.path.isdir(store):
        rank_coverage.combine(cov, store)
        shutil.rmtree(store, ignore_errors=True)
