"""Device locks (flock), held while a gang runs a job: K slots per device, so that at most K gangs
hold a device at once (`--megatron-gangs-per-device K`); an exclusive hold takes every slot.

Safety does not depend on the scheduler: gangs that share a device, in two xdist workers or
two pytest sessions pointed at one `--megatron-lock-dir`, take turns once its slots are taken.
Each device also has a turnstile, held only while slots are being taken: an exclusive holder
waiting for the last slots keeps newcomers out, so it is not starved by a stream of shared ones.
The kernel drops a lock when its holder dies, so a killed worker never leaves a device locked.
A hold inside another of the same process (an unmarked test on its worker's home device whose
body runs a job on a gang there) keeps the slot it has: flock would make it wait for itself.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

SLOT_POLL = 0.02  # seconds between looks for a free slot while every one is taken


class DeviceLocks:
    """Locks named after physical devices, in one folder, `slots` per device."""

    def __init__(self, folder: str, slots: int = 1) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.slots = slots
        self._mine: dict[str, int] = {}  # device -> the slot this process holds now

    @contextmanager
    def hold(self, names: list[str], exclusive: bool = False) -> Iterator[None]:
        """Hold a slot of every named device, or all its slots when `exclusive` (devices taken
        in sorted order, so two holders never deadlock)."""
        fds: list[int] = []
        taken: list[str] = []
        try:
            for name in sorted(set(names)):
                mine = self._mine.get(name)
                if mine is not None and not exclusive:
                    continue
                turnstile = self._open(f"{name}.lock")
                try:
                    fcntl.flock(turnstile, fcntl.LOCK_EX)
                    if exclusive:
                        others = [slot for slot in range(self.slots) if slot != mine]
                        fds.extend(self._take(name, slot) for slot in others)
                        if mine is None:
                            self._mine[name] = others[0]
                            taken.append(name)
                    else:
                        fd, self._mine[name] = self._take_any(name)
                        fds.append(fd)
                        taken.append(name)
                finally:
                    os.close(turnstile)
            yield
        finally:
            for name in taken:
                del self._mine[name]
            for fd in reversed(fds):
                os.close(fd)  # closing the only descriptor releases its lock

    def holders(self, name: str) -> int:
        """How many slots of the device are held now (this process's own included): a slot
        that cannot be taken at once is held."""
        held = 0
        for slot in range(self.slots):
            fd = self._open(_slot_file(name, slot))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1
            finally:
                os.close(fd)
        return held

    def _take(self, name: str, slot: int) -> int:
        fd = self._open(_slot_file(name, slot))
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _take_any(self, name: str) -> tuple[int, int]:
        """The first free slot of the device (its descriptor and index), waiting for one if
        all are taken."""
        fds = [self._open(_slot_file(name, slot)) for slot in range(self.slots)]
        try:
            while True:
                for index, fd in enumerate(fds):
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    return fds.pop(index), index
                time.sleep(SLOT_POLL)
        finally:
            for fd in fds:
                os.close(fd)

    def _open(self, file_name: str) -> int:
        return os.open(os.path.join(self.folder, file_name), os.O_RDWR | os.O_CREAT)


def _slot_file(name: str, slot: int) -> str:
    return f"{name}.slot{slot}.lock"
