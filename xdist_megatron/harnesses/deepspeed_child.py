"""On a rank: what each process of DeepSpeed's test pool runs for one launch (`_dist_run`), in
the state a fresh pool process starts from.

A pool process is a fresh forkserver child: DeepSpeed's communication backend
(`deepspeed.comm`'s `cdb`) unset, its group registries (`deepspeed.utils.groups`) empty, and no
default group until `_dist_run` makes one from the test's file store. A rank imported them once
and has its gang's group. Here DeepSpeed's modules (plain values, and the registries' contents),
the test's module and the harness's are put back to what the rank first saw; where the test
initialises a group of a backend the gang's serves, `_dist_run`'s `deepspeed.init_distributed`
wraps the gang's group (as it does any group that exists) instead of making one, else the gang's
group gives way (the per-job cleanup restores it).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..ranks.isolation import restore_environ
from ..ranks.rank import rank_info
from .child_process import destroy_default_group, gang_group_serves, take_parent_environment
from .fresh_state import start_fresh

LIBRARY = "deepspeed"
REGISTRIES = ("deepspeed.comm.comm", "deepspeed.utils.groups")
BASE = "DistributedExec"


def run_rank(
    test: Any, num_procs: int, init_method: str, port: int, environ: dict[str, str]
) -> Any:
    """The harness's `_dist_run` for this rank, in its parent's `environ`: the test's skip
    message, or "" (its exception is the rank's failure, as in the pool)."""
    own_environ = dict(os.environ)
    take_parent_environment(environ, own_environ)
    # `set_accelerator_visible` rotates the visible devices by the xdist worker's number; a
    # rank's devices are the gang's already.
    os.environ.pop("PYTEST_XDIST_WORKER", None)
    try:
        _start_fresh(type(test))
        if not (test.init_distributed and gang_group_serves(str(test.backend))):
            destroy_default_group()
        return test._dist_run(rank_info().rank, num_procs, port, init_method)
    finally:
        restore_environ(own_environ)


def _start_fresh(cls: type) -> None:
    harness = next(base for base in cls.__mro__ if base.__name__ == BASE)
    named = {cls.__module__, harness.__module__}
    modules = [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name in named or name.startswith(f"{LIBRARY}."))
    ]
    registries = [sys.modules[name] for name in REGISTRIES if name in sys.modules]
    start_fresh(modules, registries)
