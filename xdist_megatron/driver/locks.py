"""Exclusive device locks (flock on one file per device), held while a gang runs a job.

Safety does not depend on the scheduler: two gangs that share a device, in two xdist workers or
two pytest sessions pointed at one `--megatron-lock-dir`, take turns. The kernel drops a lock
when its holder dies, so a killed worker never leaves a device locked.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager


class DeviceLocks:
    """Locks named after physical devices, in one folder."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder

    @contextmanager
    def hold(self, names: list[str]) -> Iterator[None]:
        """Hold every named lock (taken in sorted order, so two holders never deadlock)."""
        fds = []
        try:
            for name in sorted(set(names)):
                fd = os.open(os.path.join(self.folder, f"{name}.lock"), os.O_RDWR | os.O_CREAT)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            for fd in reversed(fds):
                os.close(fd)  # closing the only descriptor releases its lock
