"""A path given to one of the plugin's options as a separate word (`--megatron-durations PATH`)
can move pytest's rootdir and skip the suite's ini file: pytest picks both before any plugin has
added its options, and so takes the unknown option's value for a test path. The run then goes on
without the suite's ini (its options, `--deselect` ids relative to the rootdir), silently. This
finds that case and asks for the `--option=PATH` form, which pytest leaves alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PATH_OPTIONS = ("--megatron-durations", "--megatron-report", "--megatron-lock-dir")
# The files pytest reads its configuration from, as it searches a folder for them.
INI_NAMES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def check(config: pytest.Config) -> None:
    """A usage error where a separate path moved the ini search past a folder holding an ini."""
    here = config.invocation_params.dir
    ancestor = _common_folder([_existing(here, arg.split("::")[0]) for arg in config.args], here)
    args = list(config.invocation_params.args)
    for option, value in zip(args, args[1:], strict=False):
        path = _existing(here, value) if option in PATH_OPTIONS else None
        if path is None or path.is_relative_to(ancestor):
            continue
        skipped = _ini_between(ancestor, Path(os.path.commonpath([ancestor, path])))
        if skipped is not None:
            raise pytest.UsageError(
                f"{option} {value}: pytest took {value} for a test path when it chose the rootdir "
                f"({config.rootpath}), so it did not read {skipped}; write {option}={value}"
            )


def _existing(folder: Path, arg: str) -> Path | None:
    path = (folder / arg).resolve()
    return path if path.exists() else None


def _common_folder(paths: list[Path | None], default: Path) -> Path:
    found = [path if path.is_dir() else path.parent for path in paths if path is not None]
    return Path(os.path.commonpath(found)) if found else default


def _ini_between(start: Path, stop: Path) -> Path | None:
    """The first ini file pytest would have found from `start` up, below `stop`."""
    for folder in [start, *start.parents]:
        if folder == stop:
            return None
        for name in INI_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None
