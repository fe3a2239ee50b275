"""What the zygote imports ahead of the ranks: the driver's imports that are library code,
installed or the project's own, never test code (the zygote imports no test module, conftest file
or helper beside them: each rank imports those itself, in its own session, after its conftest
files); `megatron_preload` where the ini sets it; and what the last session detected, kept in the
pytest cache so that the next zygote can start importing before collection instead of after it.
Where ranks use GPUs, the modules an earlier session's zygote found to initialise CUDA at import
(kept in the cache too) are left to the ranks: each would cost the session a replacement zygote.

The project's own code counts as a library where no package on its dotted path is named `test*`
and it lies in no test folder: a folder below the rootdir that holds a conftest file or a test
module (by `python_files`), nor one under such a folder (`tests/_test_utils` beside
`tests/conftest.py`, as in Model-Optimizer). The rootdir is a test folder where it holds a test
module; where it holds only a conftest file (common where the library lies beside the tests),
only for the modules directly in it. The folders are read from the disk: pytest keeps one
`conftest` module in sys.modules at a time, so the loaded modules named too few of them.
Megatron-LM keeps `megatron/training` beside `tests/`, and its unit tests' conftest imports it
(and transformers with it): ~2 s each rank paid before its first test, and again on every
replacement gang, when only installed packages were preloaded.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any

import pytest

from ..ci import early_cache

ALWAYS_PRELOAD = ("torch", "torch.distributed")
CACHE_KEY = "xdist_megatron/preload"
CUDA_AT_IMPORT_KEY = "xdist_megatron/cuda_at_import"
NOT_PRELOADED = {"pytest", "_pytest", "pluggy", "xdist", "execnet", "xdist_megatron", "py"}
# PyTorch's own test harness takes device facts at import (`common_utils.TEST_CUDA` asks CUDA's
# driver; DTensor's device count): a rank imports it itself, as a spawned child would.
NOT_PRELOADED_PACKAGES = ("torch.testing",)


class Preloadable:
    """Sorts imported modules into library code (preloadable) and test code."""

    def __init__(
        self, rootdir: str, python_files: list[str], left_to_ranks: Iterable[str] = ()
    ) -> None:
        self.rootdir = os.path.realpath(rootdir)
        self.patterns = python_files  # of test modules
        self.test_files_in: dict[str, tuple[bool, bool]] = {}  # see _test_files
        self.left_to_ranks = set(left_to_ranks)  # they initialise CUDA at import
        self.withheld: set[str] = set()  # modules not preloaded for that

    def modules(self, module_name: str) -> set[str]:
        """The module if it is library code; for a namespace package (`import megatron.core`
        binds `megatron`, which has no file), its imported library children. Not a script run
        as `__main__`, nor a module registered under another name than its own."""
        if module_name.partition(".")[0] in NOT_PRELOADED or _within(
            module_name, NOT_PRELOADED_PACKAGES
        ):
            return set()
        module = sys.modules.get(module_name)
        if getattr(module, "__name__", None) != module_name or module_name.startswith("__"):
            return set()
        if getattr(module, "__file__", None):
            return {module_name} if self.is_library(module) else set()
        depth = module_name.count(".") + 1
        return {
            name
            for name, child in list(sys.modules.items())
            if name.startswith(module_name + ".")
            and name.count(".") == depth
            and self.is_library(child)
        }

    def initialises_cuda(self, module_name: str) -> bool:
        """Whether importing it imports a module known to initialise CUDA: itself or a parent
        (noted in `withheld`, for the terminal summary)."""
        parts = module_name.split(".")
        if any(".".join(parts[:n]) in self.left_to_ranks for n in range(1, len(parts) + 1)):
            self.withheld.add(module_name)
            return True
        return False

    def is_library(self, module: Any) -> bool:
        """Installed code (site-packages, or a folder outside the project and the standard
        library, such as a `pip install --target` tree), or the project's own outside its tests."""
        path = getattr(module, "__file__", None)
        if not path:
            return False
        if "site-packages" in path or "dist-packages" in path:
            return True
        path = os.path.realpath(path)
        if any(_inside(path, folder) for folder in _stdlib()):
            return False
        if not _inside(path, self.rootdir):
            return True
        names = module.__name__.split(".")
        if any(name.startswith("test") or name == "conftest" for name in names):
            return False
        return not self._in_test_folder(os.path.dirname(path))

    def _in_test_folder(self, folder: str) -> bool:
        """Whether `folder` (inside the rootdir) lies in a test folder: itself or one above it
        below the rootdir holds a conftest file or a test module; the rootdir counts where it
        holds a test module, or a conftest file for the modules directly in it."""
        if folder == self.rootdir:
            return any(self._test_files(folder))
        while folder != self.rootdir:
            if any(self._test_files(folder)):
                return True
            parent = os.path.dirname(folder)
            if parent == folder:  # not inside the rootdir after all
                return False
            folder = parent
        _, test_modules = self._test_files(folder)
        return test_modules

    def _test_files(self, folder: str) -> tuple[bool, bool]:
        """Whether `folder` holds a conftest file, and whether it holds a test module."""
        if folder not in self.test_files_in:
            try:
                names = os.listdir(folder)
            except OSError:
                names = []
            self.test_files_in[folder] = (
                "conftest.py" in names,
                any(fnmatch.fnmatch(name, pattern) for name in names for pattern in self.patterns),
            )
        return self.test_files_in[folder]

    def imported_by(self, items: list[pytest.Item]) -> list[str]:
        """Library modules the collected test modules imported."""
        found: set[str] = set()
        test_modules = {id(m): m for m in (getattr(i, "module", None) for i in items) if m}
        for module in test_modules.values():
            for value in list(vars(module).values()):
                if isinstance(value, type(sys)):
                    source = value.__name__
                else:
                    source = getattr(value, "__module__", None)
                if isinstance(source, str):
                    found |= self.modules(source)
        return sorted(found)


def _within(module_name: str, packages: tuple[str, ...]) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in packages)


PRELOADABLE = pytest.StashKey[Preloadable]()


def preloadable_of(config: pytest.Config) -> Preloadable:
    """The session's one judge of what the zygote may import."""
    if PRELOADABLE not in config.stash:
        rootdir = str(config.rootpath)
        config.stash[PRELOADABLE] = Preloadable(
            rootdir, config.getini("python_files"), known_cuda_initialisers(config)
        )
    return config.stash[PRELOADABLE]


def withheld_notes(config: pytest.Config) -> list[str]:
    """The terminal summary's word on the modules not preloaded because an earlier session
    found they initialise CUDA."""
    withheld = sorted(preloadable_of(config).withheld)
    if not withheld:
        return []
    return [
        f"not preloaded, as earlier sessions found they initialise CUDA at import (pytest "
        f"cache: {CUDA_AT_IMPORT_KEY}): {', '.join(withheld)}"
    ]


def for_session(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """megatron_preload, or the library modules the collected test modules imported (what
    the import follower sent besides is not asked again)."""
    judge = preloadable_of(config)
    found = config.getini("megatron_preload") or judge.imported_by(items)
    return with_base([m for m in found if not judge.initialises_cuda(m)])


def known_early(config: pytest.Config) -> list[str] | None:
    """The preloads known before collection: megatron_preload, else what the last session that
    ran gangs detected; None when neither says gangs will run."""
    known = config.getini("megatron_preload") or remembered(config)
    if known is None:
        return None
    judge = preloadable_of(config)
    return with_base([m for m in known if not judge.initialises_cuda(m)])


def remembered(config: pytest.Config) -> list[str] | None:
    """The detected preloads of the last session that ran gangs; None if none is remembered."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return None
    value = cache.get(CACHE_KEY, None)
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        return None
    return value


def remember(config: pytest.Config, modules: list[str]) -> None:
    """Keep this session's detected preloads for the next one."""
    cache = getattr(config, "cache", None)
    detected = [m for m in modules if m not in ALWAYS_PRELOAD]
    if cache is not None and remembered(config) != detected:
        cache.set(CACHE_KEY, detected)


def known_cuda_initialisers(config: pytest.Config) -> list[str]:
    """The modules earlier sessions' zygotes found to initialise CUDA at import; none where the
    ranks run on CPUs, which never touch CUDA."""
    if not gpus_likely(getattr(config.known_args_namespace, "megatron_devices", None)):
        return []
    value = early_cache.value(config, CUDA_AT_IMPORT_KEY)
    return [m for m in value if isinstance(m, str)] if isinstance(value, list) else []


def remember_cuda_initialisers(config: pytest.Config, modules: Iterable[str]) -> None:
    """Add this session's findings for the next sessions. xdist workers each add theirs, unlocked:
    one may miss another's, which a later session then finds again (one replacement zygote)."""
    cache = getattr(config, "cache", None)
    known = known_cuda_initialisers(config)
    new = set(modules) - set(known)
    if cache is not None and new:
        cache.set(CUDA_AT_IMPORT_KEY, sorted({*known, *new}))


def gpus_likely(devices: str | None) -> bool:
    """Whether the ranks will use GPUs, asked without importing torch (the conftest files may be
    importing it now): --megatron-devices is not CPU mode and the driver is there."""
    return not (devices or "").startswith("cpu") and os.path.exists("/dev/nvidiactl")


def with_base(modules: list[str]) -> list[str]:
    return list(dict.fromkeys([*ALWAYS_PRELOAD, *modules]))


@functools.cache
def _stdlib() -> frozenset[str]:
    """The standard library's folders (asked once, not for every imported name)."""
    return frozenset(os.path.realpath(sysconfig.get_path(n)) for n in ("stdlib", "platstdlib"))


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder
