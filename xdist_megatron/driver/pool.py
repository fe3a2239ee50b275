"""The driver's gangs for the session: one per world size, one zygote, module-boundary resets."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .. import placement
from ..protocol import (
    FAILED,
    GangEvent,
    Job,
    RankResult,
    ResetJob,
    describe_exit,
)
from .gang import Gang, GangError, retire_cause
from .locks import DeviceLocks
from .zygote_client import ForkRefused
from .zygote_keeper import ZygoteKeeper

RESET_TIMEOUT = 120.0
SESSION_SCOPE, MODULE_SCOPE = "session", "module"


class GangPool:
    """Starts gangs on first use and keeps them for the session (or the module)."""

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
        self.events: list[GangEvent] = []  # gang starts and retirements, for the run report
        self.gang_names: dict[int, str] = {}  # world size -> the current gang's name, "ws2#1"
        self.last_hold: tuple[float, float] | None = None  # when the last job held its devices
        # Gangs holding each of the last job's devices as it ended (K > 1 only): what an out of
        # memory failure says.
        self.sharing: dict[str, int] = {}
        # Bytes in use on each device of the last job's block as it ended, by every process
        # (empty: no rank had CUDA): the run report's peak GPU memory per device.
        self.last_gpu_used: tuple[int, ...] = ()
        self._logged_retired: set[str] = set()
        self._gangs: dict[int, Gang] = {}
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
            gang = self.acquire(world_size, module, timeout, nodeid)
            results = gang.execute(job, timeout)
        self.last_hold = (held_from, time.time())
        used = [r.gpu_used for r in sorted(results, key=lambda r: r.rank)]
        self.last_gpu_used = tuple(used) if any(used) else ()
        if not gang.alive:
            self._log_retired(world_size, retire_cause(results))
        return results

    def prepare(self, world_size: int) -> None:
        """Wait for the zygote's imports, then start the gang of `world_size` if it has none, all
        before taking the devices from others (forking and joining create contexts only)."""
        self.zygote.live()
        self._ensure_started(world_size)

    def _ensure_started(self, world_size: int) -> None:
        gang = self._gangs.get(world_size)
        if gang is not None and not gang.alive:
            self._log_retired(world_size, "a failure in a test")  # one the `gang` fixture ran
        if gang is None or not gang.alive:
            self._start(world_size)

    def trim(self, keep: set[int]) -> None:
        """Shut down gangs of sizes this worker will not run again: they hold device memory."""
        for world_size in [s for s in self._gangs if s not in keep]:
            gang = self._gangs.pop(world_size)
            if gang.alive:
                self._log_retired(world_size, "not needed again here")
            gang.close()

    def acquire(
        self, world_size: int, module: str, timeout: float, nodeid: str | None = None
    ) -> Gang:
        """A live gang of `world_size` ranks, reset to its start-up state if `module` (of the test
        `nodeid`, where known) is new to it."""
        gang = self._gangs.get(world_size)
        lost = gang.lost_ranks() if gang is not None and gang.alive else []
        if lost:
            rank = lost[0]
            client = self.zygote.client
            code = client.reported_exit(gang.pids[rank]) if client is not None else None
            why = f"rank {rank} {describe_exit(code)} between tests"
            self.notes.append(f"gang of {world_size}: {why}; replaced it")
            gang.retire()
            self._log_retired(world_size, "a rank died between tests")
        if gang is not None and gang.alive and gang.last_module not in (None, module):
            self._cross_module_boundary(gang, module, nodeid)  # a failed reset ends the gang
        self._ensure_started(world_size)
        gang = self._gangs[world_size]
        gang.last_module = module
        gang.timeout = timeout
        return gang

    def _cross_module_boundary(self, gang: Gang, module: str, nodeid: str | None) -> None:
        """Reset `gang` for `module`, or end it (module scope, or a reset that failed: `execute`
        retired it) for `_ensure_started` to replace."""
        if self.scope == MODULE_SCOPE:
            gang.close()
            self._log_retired(gang.world_size, "module scope")
            return
        results = gang.execute(ResetJob(nodeid), RESET_TIMEOUT)
        failed = [r for r in results if r.outcome == FAILED]
        if failed:
            self.notes.append(
                f"gang of {gang.world_size}: reset before {module} failed on rank "
                f"{failed[0].rank} ({failed[0].message}); replaced it with a fresh gang"
            )
            self._log_retired(gang.world_size, "reset failed")

    def _start(self, world_size: int) -> Gang:
        try:
            return self._start_once(world_size)
        except ForkRefused:  # another worker's preload spoilt the shared zygote: live()
            try:  # has a fresh one start without it
                return self._start_once(world_size)
            except ForkRefused as exc:
                raise GangError(str(exc)) from None

    def _start_once(self, world_size: int) -> Gang:
        gang = Gang(
            world_size,
            self.devices,
            self.block(world_size),
            self.backend,
            zygote=self.zygote.live(),
            workdir=self._workdir,
            gangs_at_once=self.gangs_at_once,
        )
        self._gangs[world_size] = gang
        try:
            gang.start()
        except ForkRefused:
            del self._gangs[world_size]
            raise
        except GangError as exc:
            raise GangError(f"{exc}\n{self.zygote.log_tail()}") from None
        self._log_started(world_size)
        return gang

    def _log_started(self, world_size: int) -> None:
        cause = "replaced a retired one" if world_size in self.gang_names else "first use"
        count = sum(e.kind == "start" and e.world_size == world_size for e in self.events) + 1
        self.gang_names[world_size] = f"ws{world_size}#{count}"
        name = self.gang_names[world_size]
        self.events.append(GangEvent(time.time(), "start", world_size, name, cause))

    def _log_retired(self, world_size: int, cause: str) -> None:
        """Note that the current gang of `world_size` retired (once, under the first cause seen)."""
        name = self.gang_names.get(world_size)
        if name is not None and name not in self._logged_retired:
            self._logged_retired.add(name)
            self.events.append(GangEvent(time.time(), "retire", world_size, name, cause))

    def close(self, at_once: bool = False) -> None:
        """Shut every gang and the zygote down; nothing of ours outlives this. `at_once`
        (Ctrl-C): the zygote goes first, and takes the ranks with it, instead of waiting
        for it to answer (see ZygoteClient.close)."""
        if at_once:
            self.zygote.close(at_once=True)
        for gang in self._gangs.values():
            gang.close()
        self._gangs.clear()
        self.zygote.close()
