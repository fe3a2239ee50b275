"""Compiled code shared by the session's processes where the user turned bytecode writing off
(`PYTHONDONTWRITEBYTECODE`, `python -B`: common in CI images).

Without it every process compiles every module it imports from source that has no `.pyc` yet:
the driver at collection, then the zygote, each xdist worker and each rank again, and pytest
rewrites each test module's asserts once more in every rank that imports it. On an H200 host,
compiling and rewriting were 24.6 s of a profiled 57 s collection of Megatron-LM's suite, in that
one process. So the driver writes bytecode after all, only into a folder of its own
(`sys.pycache_prefix`), which the zygote, and so every worker and rank forked from it, reads and
writes too, and which is removed when the session ends: nothing is written beside the sources,
as the user asked, and the bytecode installed beside them is still read (`pycache.py`). The
environment is left as it is, so the tests' own subprocesses still write nothing.
"""

from __future__ import annotations

import shutil
import sys
import tempfile

import pytest

from .. import pycache
from ..roles import started_as


def share(config: pytest.Config) -> None:
    """Where bytecode writing is off in a driver, turn it on into a session folder, until the
    session ends. Ranks and xdist workers get the driver's settings from their zygote."""
    collect_only = config.known_args_namespace.collectonly
    if not sys.dont_write_bytecode or collect_only or not started_as().owns_session:
        return
    folder = tempfile.mkdtemp(prefix="xdist-megatron-pyc-")
    before = sys.pycache_prefix

    def restore() -> None:
        pycache.stop(before, write=False)
        shutil.rmtree(folder, ignore_errors=True)

    pycache.share(folder)
    config.add_cleanup(restore)
