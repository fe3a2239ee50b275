"""The driver's composition root: one per driver (the serial pytest process or an xdist
worker), holding its devices, its gang pool and zygote, its folders and what it will say in the
terminal summary. Built once the run is known to use the plugin (plugin.py), found through
`RUNTIME`. The controller's is controller/runtime.py, a rank's ranks/inprocess.py.

Light to import, as pytest loads the plugin in every run and the Ctrl-C latch (interrupts.py)
looks its Runtime up in every driver: the pool, the gangs, the zygote's client and the ranks'
side load when a Runtime first needs them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .. import markers, placement, sidechannel
from ..devices import gangs_per_device, run_devices
from ..placement import DeviceSet
from ..protocol import (
    CLOSE_NOW,
    HARNESS,
    INPUT_KEY,
    ITEMS,
    WHOLE_CLASS,
    WORLD_SIZE,
    SessionArgs,
    module_of,
)
from ..roles import Role, role_of
from . import import_follower, preload
from .locks import DeviceLocks

if TYPE_CHECKING:
    from .pool import GangPool

# pytest-cov off in a rank's session, its disabled plugin unregistered (it would fail no_cover).
NO_COV = ("--no-cov", "-p", "no:_cov")


class Runtime:
    """This process's plugin state: its devices and, once a marked test runs, its gangs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.default_world_size = markers.default_world_size(config)
        self.xdist: dict | None = getattr(config, "workerinput", {}).get(INPUT_KEY)
        self.worker = self.xdist["worker"] if self.xdist else 0
        self._session_dir: str | None = self.xdist["session_dir"] if self.xdist else None
        self._session_dir = import_follower.followed_session_dir(config) or self._session_dir
        from .gang_slot import MODULE_SCOPE, SESSION_SCOPE

        scope = config.getini("megatron_gang_scope")
        if scope not in (SESSION_SCOPE, MODULE_SCOPE):
            raise pytest.UsageError(f"megatron_gang_scope must be session or module, got {scope!r}")
        self.scope = scope
        self._devices: DeviceSet | None = None
        self._pool: GangPool | None = None
        self._session_args: SessionArgs | None = None
        self._next_on_gang: dict[str, str | None] | None = None
        self._notes: list[str] = []  # what the closed pools and the follower said
        config.stash[CLOSE_NOW] = functools.partial(self.close, at_once=True)

    @property
    def devices(self) -> DeviceSet:
        if self._devices is None and self.xdist:
            self._devices = placement.from_dict(self.xdist["devices"])
        if self._devices is None:
            self._devices = run_devices(self.config)
        return self._devices

    @property
    def device_count(self) -> int:
        """The devices "all" means: the driver's (its ranks are told the same count)."""
        return self.devices.count

    def unfit(self, world_size: int) -> str | None:
        """Why a test of this size cannot run here."""
        if world_size <= self.devices.count:
            return None
        return f"needs {world_size} devices, {self.devices.count} available"

    def runs_on_ranks(self, item: pytest.Item) -> bool:
        """A test this driver sends to a gang: it has a world size that fits the devices, and
        does not request the `gang` fixture or belong to a spawn harness (whose test body stays
        here)."""
        world_size = item.stash.get(WORLD_SIZE, None)
        return (
            world_size is not None
            and isinstance(item, pytest.Function)
            and "gang" not in item.fixturenames
            and HARNESS not in item.stash
            and world_size <= self.devices.count
        )

    def session_args(self) -> SessionArgs:
        """How a rank builds this session again (the same for every test)."""
        if self._session_args is None:
            config = self.config
            factory = getattr(config, "_tmp_path_factory", None)
            base = factory.getbasetemp() if factory is not None else Path(self.session_dir)
            (base / "ranks").mkdir(exist_ok=True)
            self._session_args = SessionArgs(
                args=[str(a) for a in config.invocation_params.args],
                invocation_dir=str(config.invocation_params.dir),
                sys_path=list(sys.path),
                basetemp=str(base / "ranks"),
                # pytest-cov would start on each rank and write the driver's data files; the
                # rank measures itself for the driver (rank_coverage).
                extra=NO_COV if config.pluginmanager.hasplugin("_cov") else (),
            )
        return self._session_args

    def next_on_gang(self, item: pytest.Item, nextitem: pytest.Item | None) -> str | None:
        """The next test the gang of `item` will run, where this driver knows it: pytest's
        `nextitem` when it runs on that gang too; serially, the next one of its world size in the
        session's order. Under xdist nothing further is known: None (its scopes up to the
        session's end)."""
        world_size = item.stash[WORLD_SIZE]
        if nextitem is not None and self.runs_on_ranks(nextitem):
            if nextitem.stash[WORLD_SIZE] == world_size:
                return nextitem.nodeid
        if self.xdist:
            return None
        if self._next_on_gang is None:
            self._next_on_gang = {}
            last: dict[int, str] = {}
            for later in reversed(item.session.items):
                if self.runs_on_ranks(later):
                    later_size = later.stash[WORLD_SIZE]
                    self._next_on_gang[later.nodeid] = last.get(later_size)
                    last[later_size] = later.nodeid
        return self._next_on_gang.get(item.nodeid)

    @property
    def session_dir(self) -> str:
        """Folder shared by the controller and its workers (created by the controller)."""
        if self._session_dir is None:
            self._session_dir = tempfile.mkdtemp(prefix="xdist-megatron-session-")
        return self._session_dir

    @property
    def host_zygote_log(self) -> str:
        """Where the zygote the session's drivers share writes its output."""
        from .zygote_client import HOST_ZYGOTE_LOG

        return os.path.join(self.session_dir, HOST_ZYGOTE_LOG)

    @property
    def lock_dir(self) -> str:
        """--megatron-lock-dir; else the session's (the controller's, under xdist). An xdist
        worker whose controller did not use the plugin (it found tests on gangs only now) has
        no session of the workers' to share: it shares the user's folder of the host, so that
        its workers' gangs still take turns on a device."""
        chosen = self.config.getoption("megatron_lock_dir")
        if chosen:
            return os.path.abspath(chosen)
        if self.xdist:
            return self.xdist["lock_dir"]
        if role_of(self.config) is Role.WORKER:
            return os.path.join(tempfile.gettempdir(), f"xdist-megatron-locks-{os.getuid()}")
        return os.path.join(self.session_dir, "locks")

    @functools.cached_property
    def locks(self) -> DeviceLocks:
        """The device locks every gang job and (under xdist) every unmarked test holds."""
        return DeviceLocks(self.lock_dir, self.devices.gangs_per_device)

    @property
    def pool(self) -> GangPool:
        if self._pool is None:
            from .gang import default_backend
            from .pool import GangPool

            self._pool = GangPool(
                self.devices,
                self.config.getoption("megatron_backend") or default_backend(self.devices),
                self.preload,
                self.largest_size,
                self.locks,
                self.worker,
                self.scope,
                quiet_zygote=self.config.getoption("capture") != "no",
                host_zygote=self.xdist.get("zygote") if self.xdist else None,
                host_zygote_log=self.host_zygote_log,
                name=getattr(self.config, "workerinput", {}).get("workerid"),
                gangs_at_once=self.gangs_at_once(),
            )
        return self._pool

    def gangs_at_once(self) -> int:
        """How many gangs may run on this host at once: one per xdist worker, at most K per
        device; one in a serial run."""
        if not self.xdist:
            return 1
        slots = self.devices.count * gangs_per_device(self.config)
        return max(1, min(self.config.workerinput["workercount"], slots))

    def home_device_held(self) -> contextlib.AbstractContextManager:
        """Under xdist, an unmarked test holds its worker's home device like a gang would."""
        if not self.xdist:
            return contextlib.nullcontext()
        home = placement.home_device(self.devices, self.worker)
        return self.locks.hold([self.devices.lock_name(home)])

    def trim_gangs(self, world_size: int) -> None:
        """Shut down this worker's idle gangs of sizes the scheduler will not send it again."""
        if self.xdist and self._pool is not None:
            needed = sidechannel.sizes_still_needed(self.session_dir, self.worker)
            if needed is not None:
                self._pool.trim(needed | {world_size})

    def largest_size(self) -> int:
        """How many ranks the zygote keeps forked ahead of need: the largest gang of the session
        when this process runs them all; under xdist none until a gang asks (a worker may never
        run the large ones, and every standby rank is a process on a shared host)."""
        if self.xdist:
            return 0
        sizes = [item.stash.get(WORLD_SIZE, 0) for item in self.config.stash.get(ITEMS, [])]
        return min(max(sizes, default=0), self.devices.count)

    def preload(self) -> list[str]:
        return preload.for_session(self.config, self.config.stash.get(ITEMS, []))

    def start_zygote_early(self) -> None:
        """Before collection: have the zygote import what is known already (configured, or
        remembered from the last session), so its imports overlap with the collection's."""
        config = self.config
        if config.option.collectonly:
            return
        follower = config.stash.get(import_follower.FOLLOWER, None)
        if follower is not None:
            remembered = preload.remembered(config)
            if remembered:
                follower.want(remembered)
            return
        modules = preload.known_early(config)
        if modules is not None:
            self.pool.zygote.start_early(modules)

    def collection_done(self, items: list[pytest.Item]) -> None:
        """Start the zygote as soon as a test will need gangs (its imports take seconds), or
        stop the one started early when none will."""
        if self.config.option.collectonly:
            return
        early = import_follower.early_zygote(self.config, self.devices.is_cuda, self._notes)
        if any(WORLD_SIZE in item.stash for item in items):
            if early is not None:
                self.pool.zygote.adopt(early, self.host_zygote_log)
            self.pool.zygote.prestart()
            if self.worker == 0:  # one writer per session
                preload.remember(self.config, self.preload())
            return
        if early is not None:
            early.close()
        if self._pool is not None:
            self._pool.zygote.stop()

    def assigned(self, items: list[pytest.Item]) -> None:
        """Under xdist, tell the controller each item's module, world size and class (xdist
        sends ids only)."""
        if not self.xdist:
            return
        infos = {
            item.nodeid: sidechannel.ItemInfo(
                module_of(item.nodeid),
                item.stash.get(WORLD_SIZE, None),
                getattr(getattr(item, "cls", None), "__qualname__", None),
                markers.is_exclusive(item),
                item.nodeid.rpartition("::")[0] if item.stash.get(WHOLE_CLASS, False) else None,
            )
            for item in items
        }
        sidechannel.write_items(self.session_dir, self.config.workerinput["workerid"], infos)

    @property
    def notes(self) -> list[str]:
        """What the terminal summary says: the follower's and the pools' notes, and which
        modules were not preloaded because an earlier session found they initialise CUDA."""
        notes = [*self._notes, *preload.withheld_notes(self.config)]
        return notes + (self._pool.all_notes if self._pool is not None else [])

    def close(self, at_once: bool = False) -> None:
        """End the gangs and the zygotes; `at_once` (Ctrl-C): kill them rather than wait for
        a zygote that may be busy importing (no rank or zygote is left a second later)."""
        early = import_follower.finish_following(self.config, self._notes)
        if early is not None:
            early.close(at_once)
        if self._pool is not None:
            self._notes += self._pool.all_notes
            preload.remember_cuda_initialisers(self.config, self._pool.zygote.cuda_initialisers)
            self._pool.close(at_once)
            self._pool = None
        if not self.xdist and self._session_dir is not None:  # workers use the controller's
            shutil.rmtree(self._session_dir, ignore_errors=True)
            self._session_dir = None


RUNTIME = pytest.StashKey[Runtime]()
