"""A recipe: Model-Optimizer's distributed worker pools, served by xdist-megatron's gangs.

NVIDIA Model-Optimizer's GPU tests (`tests/gpu_megatron`) take a module-scoped pool fixture,
`dist_workers` (every GPU) or `dist_workers_size_N`, and call `pool.run(fn, ...)`, which calls
`fn(rank, world_size, ...)` on every worker and raises if a worker failed; each module spawns its
pools afresh, every worker importing torch, megatron.core and modelopt again. Copy gang_pool.py
beside such a conftest, put the hook and fixtures below in place of the pool's, and the tests run
unchanged on the plugin's gangs: forked from the zygote, cleaned after each test, and scheduled
by `--dist megatron`.

What changes for a test: taking a pool fixture marks it with the pool's world size, so the plugin
gives it a gang; the fixture is a `GangPool` with the pool's `run` on that gang, and the body
stays in the driver, as it did beside the pool. As the pool was spawned in its fixture, the gang
starts in the `gang` fixture's setup, off the clock of a timeout on the call alone
(`timeout_func_only`, which Model-Optimizer sets).
"""

from __future__ import annotations

from typing import Any

import pytest
from gang_pool import GangPool  # a module of its own: the ranks unpickle its function by name

# The pool fixtures and their world sizes; "all" is every device of the run.
POOL_SIZES: dict[str, int | str] = {
    "dist_workers": "all",
    "dist_workers_size_1": 1,
    "dist_workers_size_2": 2,
    "dist_workers_size_4": 4,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes a pool fixture gets the pool's world size (before the plugin, which
    assigns world sizes last)."""
    for item in items:
        names = getattr(item, "fixturenames", ())  # a doctest item has none
        sizes = [POOL_SIZES[name] for name in names if name in POOL_SIZES]
        if sizes and item.get_closest_marker("world_size") is None:
            item.add_marker(pytest.mark.world_size(sizes[0]))


def _pool_fixture(name: str) -> Any:
    """A function-scoped fixture `name`: the pool on the test's gang (the pool's were per module;
    the gang outlives the test anyway)."""

    @pytest.fixture(name=name)
    def pool(gang: Any) -> GangPool:
        return GangPool(gang)

    return pool


dist_workers = _pool_fixture("dist_workers")
dist_workers_size_1 = _pool_fixture("dist_workers_size_1")
dist_workers_size_2 = _pool_fixture("dist_workers_size_2")
dist_workers_size_4 = _pool_fixture("dist_workers_size_4")
