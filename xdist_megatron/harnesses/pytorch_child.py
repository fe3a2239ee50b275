"""On a rank: what one child spawned by PyTorch's `MultiProcessTestCase` would run, in the state
a freshly spawned child starts from.

A spawned child inherits its parent's environment, imports the test module afresh and creates
the default process group itself (from the parent's rendezvous file). A rank keeps the modules it
imported and has its gang's default group, so before the child's part runs: the parent's
environment replaces the rank's (the rank's devices and the plugin's own variables stay), the
gang's default group is taken down (the per-job cleanup restores it afterwards), and the plain
values of the test module's and the harness's module and class attributes are put back to what
they were when this rank first imported them (a barrier counter such as
`distributed_test.Barrier.barrier_id` would otherwise drift between ranks after a failure and hang
the next test). The child's exit code is its verdict, as for the harness's parent:
`TestDistBackend._run` ends every passing test with `sys.exit(0)`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import traceback
import types
from multiprocessing.connection import Pipe
from typing import Any

from ..ranks.isolation import restore_environ
from ..ranks.rank import rank_info
from .child_process import destroy_default_group, take_parent_environment
from .device_view import HARNESS_PACKAGE
from .fresh_state import start_fresh


def run_child(
    module_name: str,
    class_name: str,
    test_name: str,
    file_name: str,
    environ: dict[str, str],
    kwargs: dict[str, Any],
) -> tuple[int, str | None, int]:
    """`cls._run(rank, test_name, file_name, pipe, **kwargs)` as a spawned child runs it; its
    exit code, the traceback it sent its parent (if any) and the pid that ran it."""

    rank = rank_info().rank
    own_environ = dict(os.environ)
    take_parent_environment(environ, own_environ)
    try:
        module = importlib.import_module(module_name)
        _start_fresh(module)
        destroy_default_group()
        parent_end, child_end = Pipe()
        try:
            test_case = functools.reduce(getattr, class_name.split("."), module)
            test_case._run(rank, test_name, file_name, child_end, **kwargs)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            raise
        except BaseException:  # what escapes `run_test` ends a child with Python's code 1
            traceback.print_exc()
            code = 1
        sent = _received(parent_end)
        parent_end.close()
        return code, sent, os.getpid()
    finally:  # what a child's exit takes with it: the group it made
        destroy_default_group()
        restore_environ(own_environ)


def _received(connection: Any) -> str | None:
    """What the child sent its parent before it closed its end: the traceback of a failure."""
    try:
        return connection.recv() if connection.poll() else None
    except (EOFError, OSError):
        return None


def _exit_code(code: object) -> int:
    """As the interpreter turns `sys.exit(code)` into a process's exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _start_fresh(test_module: types.ModuleType) -> None:
    """The test module and the harness's modules, as a fresh child imports them."""
    harness = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith(HARNESS_PACKAGE) and isinstance(module, types.ModuleType)
    ]
    start_fresh([test_module, *harness])


_classes: dict[str, tuple[str | None, dict[str, str]]] = {}  # a continuous class's rendezvous
# file -> why its group could not start (a skip) and this rank's own environment


def run_continuous(
    module_name: str,
    class_name: str,
    rendezvous_file: str,
    world_size: int,
    test_id: str,
    environ: dict[str, str],
) -> tuple[str, str]:
    """One test of a `MultiProcContinuousTest` class, as the class's worker runs it: joining
    the class's group first where this rank has not yet. ("ok", the test id), ("skip", why) or
    ("error", the traceback), as the worker puts them on its completion queue."""
    module = importlib.import_module(module_name)
    cls = functools.reduce(getattr, class_name.split("."), module)
    if rendezvous_file not in _classes:
        _classes[rendezvous_file] = _join_class(module, cls, rendezvous_file, world_size, environ)
    reason = _classes[rendezvous_file][0]
    if reason is not None:
        return "skip", reason
    try:
        cls._run_test_given_id(test_id)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        reason = _skip_reason(exc.code) if isinstance(exc, SystemExit) else None
        return ("skip", reason) if reason else ("error", traceback.format_exc())
    return "ok", test_id


def end_continuous(rendezvous_file: str) -> None:
    """The class ended: its group goes (no collective: a peer may have failed in one) and this
    rank's own environment comes back."""

    state = _classes.pop(rendezvous_file, None)
    if state is None:  # a replacement gang, which never joined the class
        return
    destroy_default_group()
    restore_environ(state[1])


def _join_class(
    module: types.ModuleType, cls: Any, rendezvous_file: str, world_size: int, environ: dict
) -> tuple[str | None, dict[str, str]]:
    """The start of a class's worker: the parent's environment and a fresh class, then the
    class's own group in place of the gang's."""

    own_environ = dict(os.environ)
    take_parent_environment(environ, own_environ)
    try:
        _start_fresh(module)
        destroy_default_group()
        cls.rank, cls.world_size = rank_info().rank, world_size
        try:
            cls._init_pg(cls.rank, world_size, rendezvous_file)
        except SystemExit as exc:
            reason = _skip_reason(exc.code)
            if reason is None:
                raise
            return reason, own_environ
    except BaseException:
        restore_environ(own_environ)
        raise
    return None, own_environ


def _skip_reason(code: object) -> str | None:
    """The message of the installed `TEST_SKIPS` entry with this exit code, if there is one."""
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return next((skip.message for skip in TEST_SKIPS.values() if skip.exit_code == code), None)
