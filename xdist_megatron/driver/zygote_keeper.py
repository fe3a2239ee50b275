"""A driver's zygote, kept alive: joined (the xdist controller's shared one) or started on first
use, or early, before collection; replaced when it dies or when a preload spoilt CUDA for its
forks; what it said of its preloads, for the terminal summary and the next session's cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

from .. import placement
from ..protocol import CUDA_AT_IMPORT
from .gang import GangError
from .preload import ALWAYS_PRELOAD
from .zygote_client import ZygoteClient


class ZygoteKeeper:
    """The zygote a driver's gangs fork from."""

    def __init__(
        self,
        devices: placement.DeviceSet,
        preload: Callable[[], list[str]],
        largest_size: Callable[[], int],
        workdir: str,
        quiet: bool = True,
        host_zygote: str | None = None,
        host_zygote_log: str | None = None,
        name: str | None = None,
    ) -> None:
        self.devices = devices
        self.client: ZygoteClient | None = None
        self.notes: list[str] = []  # things the terminal summary should say
        self.cuda_initialisers: set[str] = set()  # preloads left to GPU ranks: cached for later
        self._preload = preload
        self._largest_size = largest_size
        self._workdir = workdir
        self._quiet = quiet
        self._checked: ZygoteClient | None = None  # the zygote whose preload failures are noted
        self._started_early = False  # before collection; it has not heard what collection found
        self._host_zygote = host_zygote  # the address of a shared zygote, tried first
        self._host_zygote_log = host_zygote_log
        self._name = name  # this driver's xdist worker id, told to the shared zygote
        self._log: IO[bytes] | None = None
        self._adopted_log: str | None = None

    @property
    def log_path(self) -> str:
        """Where the ranks' output outside their tests goes (the shared zygote's, if used)."""
        if self.client is not None and self.client.process is None and self._host_zygote_log:
            return self._host_zygote_log
        if self._adopted_log is not None:
            return self._adopted_log
        return os.path.join(self._workdir, "zygote.log")

    def log_tail(self, lines: int = 30) -> str:
        """The end of the zygote's log: what ranks said before a start failed."""
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return "rank output before the failure:\n" + "\n".join(tail) if tail else ""

    def start_early(self, preload: list[str]) -> None:
        """Start the zygote before collection with the preloads known then, so its imports
        overlap with the collection's; `prestart` adds what collection found."""
        if self.client is None:
            self.client = self._spawn(preload)
            self._started_early = True

    def adopt(self, zygote: ZygoteClient, log: str) -> None:
        """Take over a zygote started before collection (logging to `log`), before any gang
        started; `prestart` adds what collection found."""
        self.client, self._adopted_log = zygote, log
        self._started_early = True

    def prestart(self) -> None:
        """Start the zygote now, so its imports overlap with whatever runs before the first gang;
        one started early imports what the collected test modules need as well."""
        if self.client is None:
            self.client = self._spawn(self._preload())
        elif self._started_early:
            self._started_early = False
            self.client.add_preload(self._preload(), standby=self._largest_size())

    def stop(self) -> None:
        """Collection found nothing for gangs: the zygote started early is not needed."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self._started_early = False

    def _spawn(self, preload: list[str], careful: bool = False) -> ZygoteClient:
        """Join the shared zygote on first use; else (or once it failed) start our own;
        `careful` where a preload spoilt the last one (see zygote/preload.py)."""
        if self._host_zygote is not None and not careful:
            address, self._host_zygote = self._host_zygote, None
            try:
                return ZygoteClient.connect(address, preload, self._name)
            except OSError as exc:
                self.notes.append(f"the shared zygote did not answer ({exc}); started our own")
        return ZygoteClient(
            preload,
            self._log_file(),
            standby=self._largest_size(),
            cuda=self.devices.is_cuda,
            careful=careful,
        )

    def live(self) -> ZygoteClient:
        """The zygote to fork from: started (or replaced, if it died or a preload spoilt CUDA
        for its forks) as needed."""
        if self.client is not None and not self.client.alive:
            self.notes.append("the zygote died; started a new one")
            self.client.close()
            self.client = None
        if self.client is None:
            self.client = self._spawn(self._preload())
        while True:
            zygote = self.client
            failures = zygote.preload_failures
            if zygote is not self._checked:  # a module only remembered from the last session
                self._checked = zygote  # and gone since then is no news
                wanted = set(self._preload())
                self.notes += [
                    f"megatron_preload: {m}: {why}" for m, why in failures.items() if m in wanted
                ]
            self.cuda_initialisers.update(m for m, why in failures.items() if why == CUDA_AT_IMPORT)
            poisoned = zygote.breaks_cuda
            if not poisoned:
                return zygote
            remaining = [m for m in zygote.preload if m not in poisoned]
            if len(remaining) == len(zygote.preload) or set(poisoned) & set(ALWAYS_PRELOAD):
                raise GangError(  # a replacement would be spoilt again, and so on
                    f"the zygote's import of {', '.join(poisoned)} initialised CUDA: no fork "
                    "could use a GPU (an LD_PRELOAD library, or a torch device-backend plugin?)"
                )
            self.cuda_initialisers.update(poisoned)  # another driver's, where it is shared
            self.notes.append(
                f"the zygote's preload of {', '.join(poisoned)} initialised CUDA: replaced it with"
                " one that tries each preload in a fork first"
            )
            zygote.close()
            self.client = self._spawn(remaining, careful=True)

    def _log_file(self) -> IO[bytes] | None:
        if not self._quiet:
            return None
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        return self._log

    def close(self, at_once: bool = False) -> None:
        """End the zygote (`at_once`: kill it, and its ranks with it, without waiting)."""
        if self.client is not None:
            self.client.close(at_once=at_once)
            self.client = None
        if self._log is not None:
            self._log.close()
            self._log = None
