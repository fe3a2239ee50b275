"""Glue (not upstream) for Model-Optimizer's `tests/gpu_megatron`, used by the conftest.py beside
it (assembled into the suite's root): the pool fixtures served from xdist-megatron's gangs, the
pools' per-run teardown as a function the ranks can import, and a count of the worker pools that
upstream's own fixtures start.

A module of its own, not a conftest: the ranks unpickle `megatron_worker_teardown` by this
module's name, and pytest must not parse the fixtures below as this folder's own (they are put
into upstream's conftest module, in place of its pool fixtures, before pytest parses it).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import pytest

PLUGIN = "xdist_megatron.plugin"  # the plugin's pytest11 entry point (xdist-megatron's pyproject)
POOL_LOG = "MODELOPT_POOL_LOG"  # where upstream's pool starts are logged, one JSON line each


def megatron_worker_teardown(rank: int, world_size: int) -> None:
    """Upstream's `megatron_worker_teardown` (tests/gpu_megatron/conftest.py at a2fbac7ba), line
    for line: its pools call it after every `run`, so a test's second `run` starts from destroyed
    model-parallel state. Upstream's own function lives in a module named `conftest`, which a
    rank cannot import by name; this copy can."""
    import modelopt.torch.utils.distributed as dist
    import torch
    from megatron.core.parallel_state import destroy_model_parallel

    apex_destroy = None
    with contextlib.suppress(ImportError):
        from apex.transformer.parallel_state import destroy_model_parallel as apex_destroy

    if dist.is_initialized():
        dist.barrier()
    try:
        destroy_model_parallel()
    except Exception as e:
        print(f"Error destroying model parallel: {e}")
    if apex_destroy is not None:
        try:
            apex_destroy()
        except Exception as e:
            print(f"Error destroying model parallel with Apex: {e}")
    torch.cuda.empty_cache()


class ModeloptGangPool:
    """The worker pool's interface on the test's gang: the recipe's GangPool with upstream's
    per-run teardown, and the pool's `world_size` (test_megatron.py reads it)."""

    def __init__(self, gang: Any) -> None:
        # examples/pool_adapter/gang_pool.py, copied unchanged; imported here (as pool_adapter.py
        # is where it is used), so that a run with the plugin disabled imports no xdist_megatron
        from gang_pool import GangPool

        self._pool = GangPool(gang, teardown_fn=megatron_worker_teardown)
        self.world_size = gang.world_size

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._pool.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _pool_fixture(name: str) -> Any:
    """A function-scoped fixture `name`: the pool on the test's gang. Upstream's are module-scoped
    (one pool per module and world size); the gang outlives the test anyway."""

    @pytest.fixture(name=name)
    def pool(gang: Any) -> ModeloptGangPool:
        return ModeloptGangPool(gang)

    return pool


def serve_pools_from_gangs(conftest: Any) -> None:
    """Replace the pool fixtures of upstream's conftest module (before pytest parses it), those
    of the recipe's table (examples/pool_adapter/conftest.py, copied as pool_adapter.py); its
    other fixtures (tiny_tokenizer_path, _prebuild_quant_cuda_extensions, _pool_cache) stay."""
    from pool_adapter import POOL_SIZES

    for name in POOL_SIZES:
        if not hasattr(conftest, name):
            raise pytest.UsageError(f"{conftest.__file__} has no fixture {name}: update the glue")
        setattr(conftest, name, _pool_fixture(name))


def mark_pool_tests(items: list[pytest.Item]) -> None:
    """A test that takes a pool fixture gets the pool's world size: the recipe's own hook."""
    from pool_adapter import pytest_collection_modifyitems

    pytest_collection_modifyitems(items)


def count_pool_starts() -> None:
    """Log every DistributedWorkerPool construction (world size, seconds to start, the test whose
    setup started it) to $MODELOPT_POOL_LOG, one JSON line each; nothing without the variable."""
    path = os.environ.get(POOL_LOG)
    if not path:
        return
    from _test_utils.torch.distributed import utils

    pool_class = utils.DistributedWorkerPool
    if getattr(pool_class, "_glue_counted", False):
        return
    original = pool_class.__init__

    def counted_init(self: Any, world_size: int, *args: Any, **kwargs: Any) -> None:
        start = time.time()
        try:
            original(self, world_size, *args, **kwargs)
        finally:
            test = os.environ.get("PYTEST_CURRENT_TEST", "")  # the test whose setup started it
            line = {"world_size": world_size, "start": start, "seconds": time.time() - start,
                    "pid": os.getpid(), "test": test}  # fmt: skip
            with open(path, "a") as log:
                log.write(json.dumps(line) + "\n")

    pool_class.__init__ = counted_init
    pool_class._glue_counted = True
