"""Device locks (flock), held while a gang runs a job: K slots per device, so that at most K gangs
hold a device at once (`--megatron-gangs-per-device K`); an exclusive hold takes every slot.

Safety does not depend on the scheduler: gangs that share a device, in two xdist workers or
two pytest sessions pointed at one `--megatron-lock-dir`, take turns once its slots are taken.
Each device also has a turnstile, held only while slots are being taken: an exclusive holder
waiting for the last slots keeps newcomers out, so it is not starved by a stream of shared ones.
The kernel drops a lock when its holder dies, so a killed worker never leaves a device locked.
A hold inside another of the same process (an unmarked test on its worker's home device whose
body runs a job on a gang) first lets go of what the outer one holds and takes it again after:
a holder never waits while holding, so two workers whose gangs span each other's home device
cannot wait for each other, and one never waits for itself.
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
        self._mine: dict[str, tuple[bool, list[int]]] = {}  # device -> (exclusive, slot fds)

    @contextmanager
    def hold(self, names: list[str], exclusive: bool = False) -> Iterator[None]:
        """Hold a slot of every named device, or all its slots when `exclusive` (devices taken
        in sorted order, so two holders never deadlock)."""
        outer = {name: held[0] for name, held in self._mine.items()}
        self._let_go(list(outer))
        names = sorted(set(names))
        try:
            self._take_all({name: exclusive for name in names})
            yield
        finally:
            self._let_go([name for name in names if name in self._mine])
            self._take_all(outer)

    def _take_all(self, wanted: dict[str, bool]) -> None:
        """Take the named devices in sorted order: every slot of an exclusive one."""
        for name in sorted(wanted):
            turnstile = self._open(f"{name}.lock")
            try:
                fcntl.flock(turnstile, fcntl.LOCK_EX)
                fds: list[int] = []
                self._mine[name] = (wanted[name], fds)
                if wanted[name]:
                    fds.extend(self._take(name, slot) for slot in range(self.slots))
                else:
                    fds.append(self._take_any(name))
            finally:
                os.close(turnstile)

    def _let_go(self, names: list[str]) -> None:
        for name in names:
            for fd in reversed(self._mine.pop(name)[1]):
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

    def _take_any(self, name: str) -> int:
        """The first free slot of the device, waiting for one if all are taken."""
        fds = [self._open(_slot_file(name, slot)) for slot in range(self.slots)]
        try:
            while True:
                for index, fd in enumerate(fds):
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    return fds.pop(index)
                time.sleep(SLOT_POLL)
        finally:
            for fd in fds:
                os.close(fd)

    def _open(self, file_name: str) -> int:
        return os.open(os.path.join(self.folder, file_name), os.O_RDWR | os.O_CREAT)


def _slot_file(name: str, slot: int) -> str:
    return f"{name}.slot{slot}.lock"
