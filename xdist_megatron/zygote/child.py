"""In any child the zygote forks (a rank, a standby, a trial import, a worker): what it does
first and last."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_zygote() -> None:
    """The kernel ends this child when the zygote (its parent) goes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def flush_and_exit(code: int) -> None:
    """End the child at once, its output flushed: no exit handler of the zygote's runs."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
