"""What the plugin knows before pytest has configured it: values of the pytest cache, read where
its plugin keeps each one (`<cache_dir>/v/<key>`, JSON), and whether the run uses the plugin.

`-n auto` is decided, and the import follower starts the zygote, while the conftest files are
still being imported; so is whether the run uses the plugin at all (`uses_plugin`). The plugin is
loaded by every pytest run of an environment that has it installed, and a run that uses none of
it must go as if it were not (no process, thread or folder, nothing of pytest replaced, nothing
written). Where the run's options and ini do not say, the record of the last runs that had tests
on gangs does (`GANG_MODULES_KEY`, written only by runs that used the plugin): a marked suite
run again gets its zygote as early as before, a plain one never has one. A run that finds tests
on gangs without either starts using the plugin at collection (its zygote starts later).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ..protocol import DIST_MODE
from ..roles import started_as

# The test modules (rootdir-relative, as in node ids) that had tests on gangs when they last ran.
GANG_MODULES_KEY = "xdist_megatron/gang_modules"
# The ini settings that say a suite runs on gangs (the others tune gangs it may not have).
GANG_INI = ("megatron_world_size", "megatron_preload")
PREFIX = "megatron_"  # of the dest of every option of the plugin
USES_PLUGIN = pytest.StashKey[bool]()


def value(config: pytest.Config, key: str) -> object:
    """The cached value of `key`; None without a cache, with --cache-clear, or when unreadable."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return cache.get(key, None)
    try:
        folder = Path(os.path.expanduser(os.path.expandvars(config.getini("cache_dir"))))
    except ValueError:  # -p no:cacheprovider: no such ini
        return None
    if config.getoption("cacheclear", False):
        return None
    try:
        return json.loads((config.rootpath / folder / "v" / key).read_text())
    except (OSError, ValueError):
        return None


def decide(config: pytest.Config, parser: pytest.Parser) -> bool:
    """Whether the run is known, before collection, to use the plugin (asked once, in
    pytest_load_initial_conftests): a gang's rank or a torchrun rank; an option of the plugin or
    `--dist megatron` on the command line; a suite whose ini gives it gangs; or, by the record,
    tests on gangs in what it collects."""
    config.stash[USES_PLUGIN] = (
        started_as().is_rank
        or _asked_for(config, parser)
        or any(config.getini(name) for name in GANG_INI)
        or _gangs_ran_in_its_paths(config)
    )
    return config.stash[USES_PLUGIN]


def uses_plugin(config: pytest.Config) -> bool:
    """What `decide` found (False where pytest never asked)."""
    return config.stash.get(USES_PLUGIN, False)


def gang_modules(config: pytest.Config) -> list[str]:
    """The record: the modules that had tests on gangs when they last ran."""
    found = value(config, GANG_MODULES_KEY)
    if not isinstance(found, list) or not all(isinstance(m, str) for m in found):
        return []
    return found


def _asked_for(config: pytest.Config, parser: pytest.Parser) -> bool:
    """`--dist megatron`, or an option of the plugin given a value other than its default."""
    known = vars(config.known_args_namespace)
    if known.get("dist") == DIST_MODE:
        return True
    defaults = vars(parser.parse_known_args([]))
    return any(
        given != defaults.get(name) for name, given in known.items() if name.startswith(PREFIX)
    )


def _gangs_ran_in_its_paths(config: pytest.Config) -> bool:
    """Whether a module the record names lies in this run's paths (`--pyargs` names modules,
    not paths: any); none given, the invocation folder (where pytest's testpaths lie)."""
    modules = gang_modules(config)
    known = config.known_args_namespace
    if not modules or known.pyargs:
        return bool(modules)
    invoked = config.invocation_params.dir
    paths = [str(arg).split("::")[0] for arg in known.file_or_dir] or ["."]
    folders = [os.path.normpath(invoked / path) for path in paths]
    return any(
        _inside(os.path.normpath(config.rootpath / module), folder)
        for module in modules
        for folder in folders
    )


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
