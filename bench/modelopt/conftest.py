"""The assembled suite's root conftest (ours, not upstream's), the same in every mode. It replaces
no fixture and no helper: upstream's conftest files run unchanged, and under xdist-megatron the
plugin's Model-Optimizer harness (xdist_megatron/harnesses/modelopt.py) serves their pools.

With $MODELOPT_POOL_LOG naming a file, one JSON line per event, from the process that runs the
fixtures (pytest, or each xdist worker; not the plugin's ranks):
- `spawned`: upstream's DistributedWorkerPool was constructed, which starts `world_size`
  processes (seconds: until every worker is ready; `ok` false where the constructor raised).
  Under the plugin that happens only where its replacement fell back to upstream's pool, or
  where a module still held upstream's class.
- `served`: the plugin's replacement was constructed: no process starts, its runs go to
  gangs.
- `holders` (after collection): which DistributedWorkerPool and spawn_multiprocess_job each
  module that holds the names has (`upstream` or the replacement's name), and whether each
  conftest's `megatron_worker_teardown` pickles by reference in this process.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
import time
import types

LOG = os.environ.get("MODELOPT_POOL_LOG")
HELPER = "_test_utils.torch.distributed.utils"
POOL, SPAWN = "DistributedWorkerPool", "spawn_multiprocess_job"
UPSTREAM: dict[str, object] = {}  # the helper module's own objects, as pytest_configure found them


def _log(**line: object) -> None:
    with open(LOG, "a") as log:  # type: ignore[arg-type]
        log.write(json.dumps(line) + "\n")


def _count(pool_class: type, kind: str) -> None:
    """Log each construction of `pool_class` as `kind` (once per class)."""
    init = pool_class.__init__
    if getattr(init, "_pool_log", False):
        return

    @functools.wraps(init)  # the signature stays: the plugin's harness checks it
    def counted(self, *args, **kwargs):
        start, ok = time.time(), False
        try:
            init(self, *args, **kwargs)
            ok = True
        finally:
            _log(kind=kind, world_size=kwargs.get("world_size", args[0] if args else None),
                 start=start, seconds=time.time() - start, ok=ok, pid=os.getpid(),
                 test=os.environ.get("PYTEST_CURRENT_TEST", ""))  # fmt: skip

    counted._pool_log = True
    pool_class.__init__ = counted


def _active() -> bool:
    return bool(LOG) and "XDIST_MEGATRON_ZYGOTE" not in os.environ  # not on the plugin's ranks


def pytest_configure(config):
    if not _active():
        return
    from _test_utils.torch.distributed import utils  # after the ini's pythonpath (tests/)

    UPSTREAM.update({POOL: utils.DistributedWorkerPool, SPAWN: utils.spawn_multiprocess_job})
    _count(utils.DistributedWorkerPool, "spawned")


def pytest_collection_finish(session):
    """After the plugin's harness installed its replacements (at the end of collection)."""
    if not _active() or not UPSTREAM:
        return
    root = str(session.config.rootpath) + os.sep
    plugins = session.config.pluginmanager.get_plugins()
    modules = {id(m): m for m in [*list(sys.modules.values()), *plugins]
               if isinstance(m, types.ModuleType)}  # fmt: skip
    holders: dict[str, dict[str, str]] = {POOL: {}, SPAWN: {}}
    teardowns = {}
    for module in modules.values():
        where = getattr(module, "__file__", None) or module.__name__
        where = where[len(root) :] if where.startswith(root) else module.__name__
        names = vars(module)
        for name, upstream in UPSTREAM.items():
            held = names.get(name)
            if held is None or not hasattr(held, "__qualname__"):
                continue
            replaced = held is not upstream
            what = f"{held.__module__}.{held.__qualname__}" if replaced else "upstream"
            holders[name][where] = what
            if replaced and name == POOL and isinstance(held, type):
                _count(held, "served")
        if callable(names.get("megatron_worker_teardown")):
            try:
                pickle.dumps(names["megatron_worker_teardown"])
                teardowns[where] = "pickles"
            except Exception as e:
                teardowns[where] = f"{type(e).__name__}: {e}"
    _log(kind="holders", pid=os.getpid(), holders=holders, teardowns=teardowns,
         conftest=getattr(sys.modules.get("conftest"), "__file__", None))  # fmt: skip
