"""The driver's gangs for the session: which world sizes have one (each a `GangSlot`, which
holds its gang's whole life), the devices each holds while it runs a job, and the zygote they
fork from."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .. import placement
from ..protocol import Job, RankResult
from .gang import Gang, GangError
from .gang_slot import SESSION_SCOPE, GangLog, GangSlot
from .locks import DeviceLocks
from .zygote_keeper import ZygoteKeeper


class GangPool:
    """A slot per world size, made on first use and kept for the session."""

    def __init__(
        self,
        devices: placement.DeviceSet,
        backend: str | None,
        preload: Callable[[], list[str]],
        largest_size: Callable[[], int],
        locks: DeviceLocks,
        worker: int = 0,
        scope: str = SESSION_SCOPE,
        quiet_zygote: bool = True,
        host_zygote: str | None = None,
        host_zygote_log: str | None = None,
        name: str | None = None,
        gangs_at_once: int = 1,
    ) -> None:
        self.devices = devices
        self.gangs_at_once = gangs_at_once  # on this host, across workers: they share its cores
        self.locks = locks
        self.worker = worker
        self.backend = backend
        self.scope = scope
        self.notes: list[str] = []  # things the terminal summary should say
        self.log = GangLog()  # gang starts and retirements, for the run report
        self.last_hold: tuple[float, float] | None = None  # when the last job held its devices
        # Gangs holding each of the last job's devices as it ended (K > 1 only): what an out of
        # memory failure says.
        self.sharing: dict[str, int] = {}
        # Bytes in use on each device of the last job's block as it ended, by every process
        # (empty: no rank had CUDA): the run report's peak GPU memory per device.
        self.last_gpu_used: tuple[int, ...] = ()
        self._slots: dict[int, GangSlot] = {}
        self._workdir = tempfile.mkdtemp(prefix="xdist-megatron-")
        self.zygote = ZygoteKeeper(
            devices,
            preload,
            largest_size,
            self._workdir,
            quiet_zygote,
            host_zygote,
            host_zygote_log,
            name,
        )

    @property
    def all_notes(self) -> list[str]:
        """What the terminal summary says of the gangs and of their zygote."""
        return self.notes + self.zygote.notes

    def block(self, world_size: int) -> tuple[int, ...]:
        """This worker's devices for a gang of `world_size` ranks."""
        block = placement.worker_block(self.devices, self.worker, world_size)
        if block is None:
            raise GangError(f"needs {world_size} devices, {self.devices.count} available")
        return block

    @contextmanager
    def devices_held(self, world_size: int, exclusive: bool = False) -> Iterator[None]:
        """Hold the device locks of the gang of `world_size` ranks while a job runs on it: a
        slot of each device, or every slot for an `exclusive_devices` test."""
        names = [self.devices.lock_name(d) for d in self.block(world_size)]
        with self.locks.hold(names, exclusive):
            yield
            if self.locks.slots > 1:
                self.sharing = {name: self.locks.holders(name) for name in names}

    def execute(
        self, world_size: int, module: str, job: Job, timeout: float, exclusive: bool = False
    ) -> list[RankResult]:
        """Run `job` on the gang of `world_size` ranks, holding its devices."""
        self.prepare(world_size)
        nodeid = getattr(job, "nodeid", None)
        with self.devices_held(world_size, exclusive):
            held_from = time.time()
            results = self.acquire(world_size, module, timeout, nodeid).execute(job, timeout)
        self.last_hold = (held_from, time.time())
        used = [r.gpu_used for r in sorted(results, key=lambda r: r.rank)]
        self.last_gpu_used = tuple(used) if any(used) else ()
        self._slot(world_size).job_done(results)
        return results

    def prepare(self, world_size: int) -> None:
        """Wait for the zygote's imports, then start the gang of `world_size` if it has none, all
        before taking the devices from others (forking and joining create contexts only)."""
        self.zygote.live()
        self._slot(world_size).ready()

    def acquire(
        self, world_size: int, module: str, timeout: float, nodeid: str | None = None
    ) -> Gang:
        """A live gang of `world_size` ranks, reset to its start-up state if `module` (of the test
        `nodeid`, where known) is new to it."""
        return self._slot(world_size).for_test(module, timeout, nodeid)

    def trim(self, keep: set[int]) -> None:
        """Shut down gangs of sizes this worker will not run again: they hold device memory."""
        for world_size in [s for s in self._slots if s not in keep]:
            self._slots.pop(world_size).retire("not needed again here")

    def _slot(self, world_size: int) -> GangSlot:
        slot = self._slots.get(world_size)
        if slot is None:
            slot = self._slots[world_size] = GangSlot(
                world_size,
                lambda: self._new_gang(world_size),
                self.scope,
                self.log,
                self.notes,
                self._reported_exit,
            )
        return slot

    def _reported_exit(self, pid: int) -> int | None:
        """How a rank ended, as the zygote now serving this driver reported it."""
        client = self.zygote.client
        return client.reported_exit(pid) if client is not None else None

    def _new_gang(self, world_size: int) -> Gang:
        """A gang of `world_size` started from the zygote (a refused fork propagates: the
        slot tries once more, on the zygote the keeper has replaced)."""
        gang = Gang(
            world_size,
            self.devices,
            self.block(world_size),
            self.backend,
            zygote=self.zygote.live(),
            workdir=self._workdir,
            gangs_at_once=self.gangs_at_once,
        )
        try:
            return gang.start()
        except GangError as exc:
            raise GangError(f"{exc}\n{self.zygote.log_tail()}") from None

    def close(self, at_once: bool = False) -> None:
        """Shut every gang and the zygote down; nothing of ours outlives this. `at_once`
        (Ctrl-C): the zygote goes first, and takes the ranks with it, instead of waiting
        for it to answer (see ZygoteClient.close)."""
        if at_once:
            self.zygote.close(at_once=True)
        for slot in self._slots.values():
            if slot.gang is not None:
                slot.gang.close()
        self._slots.clear()
        self.zygote.close()
