"""File-descriptor capture of a rank's stdout and stderr for the duration of one job.

At the fd level, so output of C++ extensions (NCCL, gloo warnings) and subprocesses is caught too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import TracebackType


class _FdRedirect:
    """Point `fd` at a temporary file; on exit put the original back and keep what was written."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def start(self) -> None:
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(self.fd)
        os.dup2(self._file.fileno(), self.fd)

    def stop(self) -> None:
        os.dup2(self._saved, self.fd)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()


class FdCapture:
    """Context manager capturing fds 1 and 2 (a no-op when `enabled` is false, as with `-s`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._out = _FdRedirect(1)
        self._err = _FdRedirect(2)

    @property
    def stdout(self) -> str:
        return self._out.text

    @property
    def stderr(self) -> str:
        return self._err.text

    def __enter__(self) -> FdCapture:
        if self.enabled:
            _flush()
            self._out.start()
            self._err.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.enabled:
            _flush()
            self._out.stop()
            self._err.stop()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
