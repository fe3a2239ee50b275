"""File-descriptor capture of a rank's stdout and stderr for the duration of one job.

At the fd level, so output of C++ extensions (NCCL, gloo warnings) and subprocesses is caught too.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType


class _FdRedirect:
    """Point `fd` at a file; on exit put the original back and keep what was written.

    The file has a name the driver knows, so that what a rank printed before it died (a CUDA
    error, an abort message) still reaches the report."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.text = ""

    def start(self) -> None:
        self._file = open(self.path, "w+b")  # noqa: SIM115 - closed in stop()
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

    def __init__(self, enabled: bool, path_prefix: str) -> None:
        self.enabled = enabled
        self._out = _FdRedirect(1, f"{path_prefix}.stdout")
        self._err = _FdRedirect(2, f"{path_prefix}.stderr")

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


def output_paths(workdir: str, pid: int) -> tuple[str, str]:
    """Where rank `pid` captures its stdout and stderr during a job (as FdCapture names them)."""
    prefix = capture_prefix(workdir, pid)
    return f"{prefix}.stdout", f"{prefix}.stderr"


def capture_prefix(workdir: str, pid: int) -> str:
    return os.path.join(workdir, f"output-{pid}")
