"""Bytecode read and written in a folder of the session's (`sys.pycache_prefix`), while the
`.pyc` files installed beside the sources are still read.

With a prefix set, Python looks for compiled code only under it: every module of an installed
package, whose `__pycache__` already holds its bytecode, would be compiled again from source, in
every process (on a 2-core box 10 s of a Megatron-LM collection's 25). So, while shared, the path
Python asks for is the one beside the source where that file is up to date (it is only read
then), and the prefix's otherwise: what has no usable bytecode is compiled once, into the prefix.
The driver shares (driver/bytecode.py) and hands its settings to its zygotes, which apply them.
"""

from __future__ import annotations

import os
import sys
from importlib import _bootstrap_external  # the loaders' own cache_from_source
from importlib.util import MAGIC_NUMBER

PLAIN = _bootstrap_external.cache_from_source
HEADER_BYTES = 16  # magic, flags, source mtime, source size
UNCHECKED_HASH = 1  # flags of a hash-based pyc the loader does not check against its source


def settings() -> dict[str, object]:
    """This process's bytecode settings, for a zygote it starts to `apply`."""
    return {
        "prefix": sys.pycache_prefix,
        "write": not sys.dont_write_bytecode,
        "shared": _bootstrap_external.cache_from_source is installed_or_shared,
    }


def apply(settings: dict[str, object]) -> None:
    """Compile as `settings` (another process's) say, sharing its folder where it shares one."""
    prefix = settings["prefix"]
    if settings["shared"] and isinstance(prefix, str):
        share(prefix)
    else:  # a prefix of the user's own is theirs: Python's rules, unchanged
        sys.pycache_prefix, sys.dont_write_bytecode = prefix, not settings["write"]


def share(folder: str) -> None:
    """Write bytecode into `folder`, and read the installed `.pyc` files where they are current."""
    sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    _bootstrap_external.cache_from_source = installed_or_shared


def stop(prefix: str | None, write: bool) -> None:
    """Back to plain Python with these settings."""
    _bootstrap_external.cache_from_source = PLAIN
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, not write


def installed_or_shared(
    path: str, debug_override: bool | None = None, *, optimization: object = None
) -> str:
    """`cache_from_source`, but the file beside `path` where it is current bytecode of it."""
    shared = PLAIN(path, debug_override, optimization=optimization)
    beside = os.path.join(os.path.dirname(path), "__pycache__", os.path.basename(shared))
    return beside if current(beside, path) else shared


def current(pyc: str, source: str) -> bool:
    """Whether the loader would use `pyc` for `source` as it is, without writing it again."""
    try:
        with open(pyc, "rb") as file:
            header = file.read(HEADER_BYTES)
        stat = os.stat(source)
    except OSError:
        return False
    if len(header) < HEADER_BYTES or header[:4] != MAGIC_NUMBER:
        return False
    flags, mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12))
    if flags:
        return flags == UNCHECKED_HASH
    return mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF
