"""The run's device count on the harness's parent side, in an xdist worker whose own CUDA view
is its home GPU.

A spawned child of a plain run sees the run's devices, and the harness decides on that count in
its parent: `common_cuda.TEST_MULTIGPU` and `common_dtensor.NUM_DEVICES` at import, a continuous
class's world size (`torch.accelerator.device_count()`) when its pool starts. A worker's
`CUDA_VISIBLE_DEVICES` names only its home GPU (for the tests that run in the worker), so there
those counts would say 1. While a module of `torch.testing._internal` is imported, and while a
harness's test runs its parent's side, both device counts answer the run's count instead;
CUDA's own view (which device `cuda:0` is) stays the worker's.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Generator
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from ..protocol import RUN_DEVICE_COUNT_VAR

HARNESS_PACKAGE = "torch.testing._internal"  # PyTorch's harness and the modules it imports


def run_device_count() -> int | None:
    """The run's device count where this worker's own view is narrower, else None."""
    value = os.environ.get(RUN_DEVICE_COUNT_VAR)
    return int(value) if value else None


@contextmanager
def run_devices_counted() -> Generator[None, None, None]:
    """`torch.cuda.device_count()` and `torch.accelerator.device_count()` give the run's count
    inside the block (nothing changes where this worker sees the run's devices)."""
    count, torch = run_device_count(), sys.modules.get("torch")
    if count is None or torch is None:
        yield
        return
    owners = [torch.cuda, getattr(torch, "accelerator", None)]
    saved = [(owner, owner.device_count) for owner in owners if owner is not None]
    for owner, _ in saved:
        owner.device_count = lambda: count
    try:
        yield
    finally:
        for owner, original in saved:
            owner.device_count = original


def follow_harness_imports() -> None:
    """From now on, the harness's modules are imported with the run's device count (once per
    process; only where this worker's view is narrower than the run's)."""
    if run_device_count() is not None and not any(
        isinstance(finder, _HarnessImports) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _HarnessImports())


class _HarnessImports(importlib.abc.MetaPathFinder):
    """Finds a harness module as the other finders do, then runs its body under
    `run_devices_counted`."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if not name.startswith(HARNESS_PACKAGE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CountedLoader(spec.loader)
                return spec
        return None


class _CountedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with run_devices_counted():
            self.loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename... for tracebacks
        return getattr(self.loader, name)
