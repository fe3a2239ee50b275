"""A path given to one of the plugin's options as a separate word (`--megatron-durations PATH`)
can move pytest's rootdir and skip the suite's ini file: pytest picks both before any plugin has
added its options, and so takes the unknown option's value for a test path. The run then goes on
without the suite's ini (its options, `--deselect` ids relative to the rootdir), silently. This
finds that case, by asking pytest's own choice again without those values, and asks for the
`--option=PATH` form, which pytest leaves alone."""

from __future__ import annotations

import inspect
import os
import shlex
from pathlib import Path

import pytest

PATH_OPTIONS = ("--megatron-durations", "--megatron-report", "--megatron-lock-dir")

Setup = tuple[Path, Path | None]  # rootdir, ini file


def check(config: pytest.Config) -> None:
    """A usage error where the values of PATH_OPTIONS changed pytest's rootdir or ini file."""
    args = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *config.invocation_params.args]
    pairs = zip(args, args[1:], strict=False)
    separate = [(option, value) for option, value in pairs if option in PATH_OPTIONS]
    if not separate:
        return
    # What pytest took for test paths then: the real ones, and the values it did not know.
    positional = [str(arg) for arg in config.known_args_namespace.file_or_dir]
    chosen = _setup(config, [*positional, *(value for _, value in separate)])
    meant = _setup(config, positional)
    if chosen is None or meant is None or chosen == meant:
        return
    option, value = separate[0]
    raise pytest.UsageError(
        f"{option} {value}: pytest took {value} for a test path when it chose the rootdir and "
        f"ini file ({_describe(chosen)}; without it: {_describe(meant)}); write {option}={value}"
    )


def _setup(config: pytest.Config, args: list[str]) -> Setup | None:
    """pytest's own choice of rootdir and ini file for `args`; None where its internal function
    is not the one this was written against (pytest 8 and 9)."""
    try:
        from _pytest.config.findpaths import determine_setup

        offered = {
            "inifile": config.option.inifilename,
            "override_ini": config.option.override_ini,
            "args": args,
            "rootdir_cmd_arg": config.option.rootdir,
            "invocation_dir": config.invocation_params.dir,
        }
        accepted = inspect.signature(determine_setup).parameters
        rootdir, inipath, *_ = determine_setup(
            **{k: v for k, v in offered.items() if k in accepted}
        )
    except Exception:  # noqa: BLE001 - a best-effort check must not break a run
        return None
    return Path(rootdir), None if inipath is None else Path(inipath)


def _describe(setup: Setup) -> str:
    rootdir, inipath = setup
    return f"rootdir {rootdir}, " + (f"ini {inipath}" if inipath else "no ini file")
