"""On a rank: what one process spawned by Model-Optimizer's `spawn_multiprocess_job` runs, or
a worker of its `DistributedWorkerPool` at each `run` (then the pool's `teardown_fn`).

The spawned process inherits its parent's environment, sets torchrun's variables, joins a
default group of the job's backend, pins device `rank` for NCCL, seeds torch with 1234 and calls
`job(rank, size)` from a freshly imported module (here: the module's plain attributes as this
rank first saw them). A rank of a gang of `size` already has such a group (the gang's, where its
backend includes the job's) and sits on device `rank`; a job of another backend gets a group of
its own, which the per-job cleanup replaces with the gang's afterwards.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..ranks.isolation import restore_environ
from ..ranks.rank import rank_info
from .child_process import destroy_default_group, gang_group_serves, take_parent_environment
from .fresh_state import start_fresh

SEED = 1234  # the harness's torch.manual_seed


def run_job(
    job: Callable[[int, int], Any], backend: str, port: int, environ: dict[str, str]
) -> None:
    """`job(rank, size)` in the state the harness's child would call it in; its exception is
    the rank's failure (the harness's child would exit non-zero)."""
    with _as_spawned(backend, port, environ) as (rank, size):
        _fresh_module_of(job)
        job(rank, size)


def run_in_pool(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    backend: str,
    teardown_fn: Callable[[int, int], Any] | None,
    port: int,
    environ: dict[str, str],
) -> None:
    """One `DistributedWorkerPool.run` on this rank: `fn(rank, world_size, *args, **kwargs)`,
    then the pool's `teardown_fn`, whose failure fails the run too, as in the pool's worker."""
    with _as_spawned(backend, port, environ) as (rank, size):
        _fresh_module_of(fn)
        try:
            fn(rank, size, *args, **kwargs)
        finally:
            if teardown_fn is not None:
                teardown_fn(rank, size)


@contextmanager
def _as_spawned(backend: str, port: int, environ: dict[str, str]) -> Iterator[tuple[int, int]]:
    """The harness's process state around a job: its parent's environment and its own
    variables, a default group of its backend, its device and its seed; the rank's own
    environment again afterwards."""
    import torch
    import torch.distributed as dist

    info = rank_info()
    rank, size = info.rank, info.world_size
    own = dict(os.environ)
    take_parent_environment(environ, own)
    os.environ.update(_child_variables(rank, size, port))
    try:
        if not gang_group_serves(backend):
            destroy_default_group()
            dist.init_process_group(backend, rank=rank, world_size=size)
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(rank)
        torch.manual_seed(SEED)
        yield rank, size
    finally:
        restore_environ(own)


def _fresh_module_of(fn: Any) -> None:
    module = sys.modules.get(getattr(getattr(fn, "func", fn), "__module__", ""))
    start_fresh([module] if module is not None else [])


def _child_variables(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(size),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "WANDB_DISABLED": "true",
    }
