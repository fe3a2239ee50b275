"""Glue (not upstream), at the root of the assembled suite, above upstream's tests/conftest.py.

With xdist-megatron active (`-p xdist_megatron.plugin`, or its entry point): the pool fixtures of
upstream's tests/gpu_megatron/conftest.py (`dist_workers`, `dist_workers_size_{1,2,4}`) are
replaced, in that module as pytest registers it and before pytest parses its fixtures, by the
recipe of examples/pool_adapter: a test that takes one gets `@pytest.mark.world_size` of the
pool's size and a pool whose `run(fn, *args)` calls fn(rank, world_size, *args) on the test's
gang, followed by upstream's per-run teardown. Every other fixture of upstream's conftest files
stays as it is (tiny_tokenizer_path, the autouse _prebuild_quant_cuda_extensions, num_gpus,
need_*_gpus, distributed_setup_size_1...), and, as beside upstream's pools, a test's body and its
fixtures run in the pytest process (the driver, or an xdist worker); only fn runs on the ranks.

With the plugin disabled (`-p no:xdist_megatron.plugin`) nothing is replaced: upstream's own
pools run, and each DistributedWorkerPool start is logged to $MODELOPT_POOL_LOG (when set).
"""

from __future__ import annotations

from pathlib import Path

import modelopt_glue
import pytest

POOL_CONFTEST = ("tests", "gpu_megatron", "conftest.py")


def _plugin_active(config_or_manager) -> bool:
    manager = getattr(config_or_manager, "pluginmanager", config_or_manager)
    return manager.has_plugin(modelopt_glue.PLUGIN)


@pytest.hookimpl(tryfirst=True)
def pytest_plugin_registered(plugin, plugin_name, manager):
    """Swap the pool fixtures of upstream's gpu_megatron conftest as it is registered (a historic
    hook: pytest parses a conftest's fixtures later, when its directory is collected)."""
    path = getattr(plugin, "__file__", None) or plugin_name or ""
    if Path(path).parts[-3:] == POOL_CONFTEST and _plugin_active(manager):
        modelopt_glue.serve_pools_from_gangs(plugin)


def pytest_configure(config):
    modelopt_glue.count_pool_starts()  # after the ini's pythonpath (tests/) is in place


def pytest_collection_modifyitems(config, items):
    if _plugin_active(config):
        modelopt_glue.mark_pool_tests(items)
