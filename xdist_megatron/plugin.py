"""pytest hooks: options, the world_size marker, rank fixtures, and marked tests run on gangs."""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from . import (
    dispatch,
    dist_mode,
    durations,
    inprocess,
    layouts,
    markers,
    metadata,
    placement,
    preload_cache,
    rank_coverage,
    run_report,
    selection,
)
from .dist_mode import (  # noqa: F401 - pytest finds these hooks on this module
    pytest_configure_node,
    pytest_handlecrashitem,
    pytest_plugin_registered,
    pytest_xdist_auto_num_workers,
    pytest_xdist_make_scheduler,
    pytest_xdist_setupnodes,
)
from .gang import (
    BASE_PRELOAD,
    DEFAULT_TIMEOUT,
    DEVICE_COUNT_VAR,
    GangError,
    default_backend,
    detect_devices,
)
from .import_follower import ImportFollower
from .inprocess import InProcessRank
from .layouts import LAYOUT
from .locks import DeviceLocks
from .markers import WORLD_SIZE
from .placement import DeviceSet
from .pool import MODULE_SCOPE, SESSION_SCOPE, GangPool
from .preloadable import Preloadable
from .protocol import FAILED, CleanupJob, RankEnd, RankInfo, SessionArgs
from .run_facts import RunFacts
from .scheduler import INPUT_KEY
from .zygote_client import ZygoteClient

# torchrun_coverage: hooks that must precede pytest-cov's; interrupts: Ctrl-C is never lost
pytest_plugins = ["xdist_megatron.torchrun_coverage", "xdist_megatron.interrupts"]

RUNTIME = pytest.StashKey["Runtime"]()
HOST_ZYGOTE_LOG = "zygote.log"  # in the session folder: output of the workers' shared zygote
TIMEOUT = pytest.StashKey[float]()
ITEMS = pytest.StashKey[list]()
PRELOADABLE = pytest.StashKey[Preloadable]()
FOLLOWER = pytest.StashKey[ImportFollower]()
XDIST_WORKER_VAR = "PYTEST_XDIST_WORKER"  # set by xdist before a worker's config is made
# pytest-cov off in a rank's session, its disabled plugin unregistered (it would fail no_cover).
_NO_COV = ("--no-cov", "-p", "no:_cov")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(
        "megatron", "xdist-megatron: distributed tests on persistent rank gangs"
    )
    group.addoption(
        "--megatron-timeout",
        type=float,
        default=None,
        help="seconds a test may run on a gang before its ranks' stacks are dumped and the gang "
        "is killed (default: ini megatron_timeout, 300).",
    )
    group.addoption(
        "--megatron-world-size",
        default=None,
        help="world size of every unmarked test, so that a suite written for `torchrun "
        "--nproc-per-node N -m pytest` runs unchanged (default: ini megatron_world_size; unset: "
        "unmarked tests run in the pytest process).",
    )
    group.addoption(
        "--megatron-devices",
        default=None,
        help="devices for gangs: '0,1,2,3' (GPU indices) or 'cpu:N' (N CPU slots); default: every "
        "visible GPU, else CPU mode with max(8, cores) slots.",
    )
    group.addoption(
        "--megatron-backend",
        default=None,
        help="torch.distributed backend of the gangs (default 'cpu:gloo,cuda:nccl' on GPUs, "
        "'gloo' on CPU).",
    )
    group.addoption(
        "--megatron-lock-dir",
        default=None,
        help="folder of the device locks; point several pytest sessions on one host at the same "
        "folder to let them share its GPUs safely (default: one folder per session).",
    )
    selection.add_options(group, parser)
    durations.add_options(group, parser)
    run_report.add_options(group)
    dist_mode.add_dist_choice(parser)
    parser.addini("megatron_timeout", "default of --megatron-timeout", default=str(DEFAULT_TIMEOUT))
    parser.addini("megatron_world_size", "default of --megatron-world-size", default="")
    parser.addini(
        "megatron_preload",
        "modules the zygote imports once for every rank, at its start (default: torch, "
        "torch.distributed and the library packages the driver imports, as it imports them)",
        type="linelist",
    )
    parser.addini(
        "megatron_gang_scope",
        "session: one gang per world size for the session, reset at module boundaries; "
        "module: a fresh gang for every module",
        default=SESSION_SCOPE,
    )


def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Start the zygote's imports beside the driver's own, before the conftest files import the
    suite's packages (see import_follower); after pytest-cov started measuring (its hook is
    tryfirst), so that a zygote started at once measures its preloads too."""
    follower = _follow_imports(early_config)
    if follower is not None:
        early_config.stash[FOLLOWER] = follower


def _follow_imports(config: pytest.Config) -> ImportFollower | None:
    """A follower for the serial driver, or the xdist controller's shared zygote; none in ranks,
    xdist workers (they join the controller's), other xdist modes and --collect-only."""
    known = config.known_args_namespace
    if inprocess.on_gang_rank() or inprocess.under_torchrun() or XDIST_WORKER_VAR in os.environ:
        return None
    controller = bool(getattr(known, "numprocesses", None) or getattr(known, "tx", None))
    if known.collectonly or (controller and getattr(known, "dist", None) != dist_mode.DIST_MODE):
        return None
    session_dir = tempfile.mkdtemp(prefix="xdist-megatron-session-")
    log = os.path.join(session_dir, HOST_ZYGOTE_LOG) if known.capture != "no" else None
    address = _shared_zygote_address() if controller else None
    devices = known.megatron_devices
    # Without importing torch (it is being imported now): GPUs are likely if the driver is there.
    cuda = not (devices or "").startswith("cpu") and os.path.exists("/dev/nvidiactl")

    def start(modules: list[str]) -> ZygoteClient:
        preload = list(dict.fromkeys([*BASE_PRELOAD, *modules]))
        return _spawn_zygote(preload, log, address, cuda)

    return ImportFollower(
        start, preloadable_of(config), config.getini("megatron_preload"), session_dir
    )


def preloadable_of(config: pytest.Config) -> Preloadable:
    """The session's one judge of what the zygote may import (it learns the test folders)."""
    if PRELOADABLE not in config.stash:
        rootdir = str(config.rootpath)
        config.stash[PRELOADABLE] = Preloadable(rootdir, config.getini("python_files"))
    return config.stash[PRELOADABLE]


def _shared_zygote_address() -> str:
    """An abstract Unix socket name, unique to this session, for its workers to connect to."""
    return f"xdist-megatron-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _spawn_zygote(
    preload: list[str], log: str | None, address: str | None, cuda: bool
) -> ZygoteClient:
    """Start a zygote writing its output to `log` (None: to this process's terminal)."""
    with open(log, "ab") if log else contextlib.nullcontext() as output:
        return ZygoteClient(preload, output, address=address, cuda=cuda)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", markers.MARKER_HELP)
    config.addinivalue_line("markers", layouts.MARKER_HELP)
    config.addinivalue_line(
        "markers", "timeout(seconds): per-test timeout, honoured on gangs as well"
    )
    runtime = config.stash[RUNTIME] = Runtime(config)
    runtime.default_timeout()  # a bad value is a usage error now, not a failure per test
    selection.check(config)
    durations.check(config)
    if config.getoption("megatron_devices") is not None and runtime.inprocess is None:
        runtime.devices  # noqa: B018 - likewise: a bad spec fails the run here, in every mode
    if runtime.inprocess is not None:
        config.pluginmanager.register(runtime.inprocess, inprocess.PLUGIN_NAME)
    else:
        dispatcher = dispatch.GangDispatch(runtime, dispatch_timeout)
        config.pluginmanager.register(dispatcher, "xdist-megatron-dispatch")
        config.pluginmanager.register(RunFacts(runtime), "xdist-megatron-run-facts")
        if not hasattr(config, "workerinput"):
            report = run_report.RunReport(config, lambda: runtime.devices.ids)
            config.pluginmanager.register(report, "xdist-megatron-run-report")
    # At exit CPython's last collections walk every object torch and megatron allocated: about
    # 2 s per process with megatron.core loaded. Frozen objects are skipped; the language does
    # not promise to finalise objects still alive at exit, and atexit handlers all still run.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    # The controller sees every report, workers need not; a gang's rank reports to its driver.
    if not hasattr(config, "workerinput") and not inprocess.on_gang_rank():
        config.pluginmanager.register(
            durations.DurationRecorder(config), "xdist-megatron-durations"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(RUNTIME, None)
    if runtime is not None:
        runtime.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[RUNTIME].close()


def pytest_report_header(config: pytest.Config) -> str | None:
    if dist_mode.requested(config) and not config.getoption("tx", None):
        return "xdist-megatron: --dist megatron without -n: marked tests run serially on gangs here"
    return None


class Runtime:
    """This process's plugin state: its devices and, once a marked test runs, its gangs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        # In a rank process (ours, or torchrun's) tests run right here.
        self.inprocess: InProcessRank | None = None
        if inprocess.on_gang_rank():
            from .rank import finish_line

            self.inprocess = InProcessRank(config, finish_line)
        elif inprocess.under_torchrun():
            self.inprocess = InProcessRank(config, None)
        self.default_size = markers.default_world_size(
            config.getoption("megatron_world_size") or config.getini("megatron_world_size")
        )
        self.xdist: dict | None = getattr(config, "workerinput", {}).get(INPUT_KEY)
        self.worker = self.xdist["worker"] if self.xdist else 0
        self._follower = config.stash.get(FOLLOWER, None)
        self._session_dir: str | None = self.xdist["session_dir"] if self.xdist else None
        if self._follower is not None:
            self._session_dir = self._follower.session_dir
        scope = config.getini("megatron_gang_scope")
        if scope not in (SESSION_SCOPE, MODULE_SCOPE):
            raise pytest.UsageError(f"megatron_gang_scope must be session or module, got {scope!r}")
        self.scope = scope
        self._devices: DeviceSet | None = None
        self._pool: GangPool | None = None
        self._host_zygote: ZygoteClient | None = None
        self._session_args: SessionArgs | None = None
        self._next_on_gang: dict[str, str | None] | None = None
        self.notes: list[str] = []  # what the pools said, for the terminal summary

    @property
    def devices(self) -> DeviceSet:
        if self._devices is None and self.xdist:
            self._devices = placement.from_dict(self.xdist["devices"])
        if self._devices is None:
            try:
                self._devices = detect_devices(self.config.getoption("megatron_devices"))
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
        return self._devices

    @property
    def device_count(self) -> int:
        """The devices "all" means: the driver's, also on its ranks; torchrun's world."""
        if inprocess.on_gang_rank():
            return int(os.environ[DEVICE_COUNT_VAR])
        if self.inprocess is not None:
            return self.inprocess.world_size
        return self.devices.count

    def runs_on_ranks(self, item: pytest.Item) -> bool:
        """A test this driver sends to a gang: it has a world size that fits the devices, and
        does not request the `gang` fixture (whose test body stays here)."""
        size = item.stash.get(WORLD_SIZE, None)
        return (
            size is not None
            and self.inprocess is None
            and isinstance(item, pytest.Function)
            and "gang" not in item.fixturenames
            and size <= self.devices.count
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
                extra=_NO_COV if config.pluginmanager.hasplugin("_cov") else (),
            )
        return self._session_args

    def next_on_gang(self, item: pytest.Item, nextitem: pytest.Item | None) -> str | None:
        """The next test the gang of `item` will run, where this driver knows it: pytest's
        `nextitem` when it runs on that gang too; serially, the next one of its size in the
        session's order. Under xdist nothing further is known: None (its scopes up to the
        session's end)."""
        size = item.stash[WORLD_SIZE]
        if nextitem is not None and self.runs_on_ranks(nextitem):
            if nextitem.stash[WORLD_SIZE] == size:
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
    def lock_dir(self) -> str:
        chosen = self.config.getoption("megatron_lock_dir")
        if chosen:
            return os.path.abspath(chosen)
        return self.xdist["lock_dir"] if self.xdist else os.path.join(self.session_dir, "locks")

    @property
    def pool(self) -> GangPool:
        if self._pool is None:
            self._pool = GangPool(
                self.devices,
                self.config.getoption("megatron_backend") or default_backend(self.devices),
                self.preload,
                self.largest_size,
                DeviceLocks(self.lock_dir),
                self.worker,
                self.scope,
                quiet_zygote=self.config.getoption("capture") != "no",
                host_zygote=self.xdist.get("zygote") if self.xdist else None,
                host_zygote_log=os.path.join(self.session_dir, HOST_ZYGOTE_LOG),
                name=getattr(self.config, "workerinput", {}).get("workerid"),
            )
        return self._pool

    def host_zygote(self) -> str:
        """In the xdist controller: the address of the zygote every worker shares, started on
        first use with the configured preloads (each worker adds the ones it detected), unless
        it started while the controller imported the suite's conftest files."""
        if self._host_zygote is None:
            self._host_zygote = self.early_zygote()
        if self._host_zygote is None:
            quiet = self.config.getoption("capture") != "no"
            self._host_zygote = _spawn_zygote(
                self.early_preload() or list(BASE_PRELOAD),
                os.path.join(self.session_dir, HOST_ZYGOTE_LOG) if quiet else None,
                _shared_zygote_address(),
                self.devices.is_cuda,
            )
        return self._host_zygote.address

    def ranks_left_with(self, worker: str, timeout: float) -> list[RankEnd] | None:
        """In the xdist controller: how the shared zygote ended the ranks of a crashed worker."""
        if self._host_zygote is None:
            return None
        return self._host_zygote.ranks_left_with(worker, timeout)

    def early_zygote(self) -> ZygoteClient | None:
        """The zygote the import follower started, if it can serve this session's devices."""
        zygote = self._finish_following()
        if zygote is not None and self.devices.is_cuda and not zygote.cuda:
            zygote.close()  # it did not guard its preloads for CUDA: forks could not use GPUs
            return None
        return zygote

    def _finish_following(self) -> ZygoteClient | None:
        """Stop the import follower (once) and take the zygote it started, if any."""
        follower = self._follower
        if follower is None:
            return None
        zygote = follower.finish()
        self._follower = None  # only now: a second Ctrl-C in the join must not lose the zygote
        if follower.error is not None:
            self.notes.append(f"following the imports to start the zygote early: {follower.error}")
        return zygote

    def home_device_held(self) -> contextlib.AbstractContextManager:
        """Under xdist, an unmarked test holds its worker's home device like a gang would."""
        if not self.xdist:
            return contextlib.nullcontext()
        home = placement.home_device(self.devices, self.worker)
        return DeviceLocks(self.lock_dir).hold([self.devices.lock_name(home)])

    def trim_gangs(self, size: int) -> None:
        """Shut down this worker's idle gangs of sizes the scheduler will not send it again."""
        if self.xdist and self._pool is not None:
            needed = metadata.sizes_still_needed(self.session_dir, self.worker)
            if needed is not None:
                self._pool.trim(needed | {size})

    def largest_size(self) -> int:
        """How many ranks the zygote keeps forked ahead of need: the largest gang of the session
        when this process runs them all; under xdist none until a gang asks (a worker may never
        run the large ones, and every standby rank is a process on a shared host)."""
        if self.xdist:
            return 0
        sizes = [item.stash.get(WORLD_SIZE, 0) for item in self.config.stash.get(ITEMS, [])]
        return min(max(sizes, default=0), self.devices.count)

    def default_timeout(self) -> float:
        """--megatron-timeout, else ini megatron_timeout; 0 means none, as in pytest-timeout."""
        value = self.config.getoption("megatron_timeout")
        text = value if value is not None else self.config.getini("megatron_timeout")
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if seconds < 0:
            raise pytest.UsageError(
                f"--megatron-timeout / megatron_timeout must be seconds >= 0, got {text!r}"
            )
        return seconds or math.inf

    def preload(self) -> list[str]:
        """megatron_preload, or the library modules the collected test modules imported (what
        the import follower sent besides is not asked again)."""
        configured = self.config.getini("megatron_preload")
        if configured:
            return list(dict.fromkeys([*BASE_PRELOAD, *configured]))
        found = preloadable_of(self.config).imported_by(self.config.stash.get(ITEMS, []))
        return list(dict.fromkeys([*BASE_PRELOAD, *found]))

    def early_preload(self) -> list[str] | None:
        """The preloads known before collection: megatron_preload, else what the last session
        that ran gangs detected (pytest cache); None when neither says gangs will run."""
        known = self.config.getini("megatron_preload") or preload_cache.load(self.config)
        if known is None:
            return None
        return list(dict.fromkeys([*BASE_PRELOAD, *known]))

    def remember_preload(self) -> None:
        """Keep this session's detected preloads for the next one (one writer per session)."""
        if self.worker == 0:
            preload_cache.save(self.config, [m for m in self.preload() if m not in BASE_PRELOAD])

    @property
    def following_imports(self) -> bool:
        return self._follower is not None

    def follow_too(self, modules: list[str]) -> None:
        """Preloads the import follower should send as well (remembered from the last session)."""
        if self._follower is not None and modules:
            self._follower.want(modules)

    def stop_early_zygote(self) -> None:
        if self._pool is not None:
            self._pool.stop_zygote()

    def close(self, at_once: bool = False) -> None:
        """End the gangs and the zygotes; `at_once` (Ctrl-C): kill them rather than wait for
        a zygote that may be busy importing (no rank or zygote is left a second later)."""
        early = self._finish_following()
        if early is not None:
            early.close(at_once)
        if self._pool is not None:
            self.notes += self._pool.notes
            self._pool.close(at_once)
            self._pool = None
        if self._host_zygote is not None:
            self._host_zygote.close(at_once)
            self._host_zygote = None
        if not self.xdist and self._session_dir is not None:  # workers use the controller's
            shutil.rmtree(self._session_dir, ignore_errors=True)
            self._session_dir = None


# -- collection -------------------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Check the test's markers (a mistake is a collection error naming the test, before any
    gang starts) and make one item per world size."""
    definition = metafunc.definition
    size_marker = definition.get_closest_marker(markers.MARKER)
    layout_marker = definition.get_closest_marker(layouts.MARKER)
    if size_marker is None and layout_marker is None:
        return
    runtime = metafunc.config.stash[RUNTIME]
    name = definition.nodeid
    try:
        for marker in definition.iter_markers(markers.MARKER):  # a class's, under the method's
            markers.declared_sizes(marker, name)
        if size_marker is not None:
            sizes = markers.parametrize_sizes(metafunc, lambda: runtime.device_count)
        elif runtime.default_size is not None:
            sizes = [runtime.default_size]
        else:
            raise layouts.LayoutError(
                f"{name}: @pytest.mark.megatron needs a world size: add "
                "@pytest.mark.world_size(N), or give the run --megatron-world-size N"
            )
        if layout_marker is not None:
            layout = layouts.layout_of(layout_marker, name)
            for size in sizes:
                layouts.check_fits(layout, size, name)
    except (markers.MarkerError, layouts.LayoutError) as exc:
        raise pytest.Collector.CollectError(str(exc)) from None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    runtime = config.stash[RUNTIME]
    config.stash[ITEMS] = items
    for item in items:
        size = markers.item_world_size(item, lambda: runtime.device_count, runtime.default_size)
        if size is None:
            continue
        item.stash[WORLD_SIZE] = size
        layout_marker = item.get_closest_marker(layouts.MARKER)
        if layout_marker is not None:
            item.stash[LAYOUT] = layouts.layout_of(layout_marker, item.nodeid)
        if inprocess.on_gang_rank():
            continue  # the driver chose what runs here
        if runtime.inprocess is not None:
            if size != runtime.inprocess.world_size:
                reason = f"needs world size {size}, torchrun started {runtime.inprocess.world_size}"
                item.add_marker(pytest.mark.skip(reason=reason))
        elif size > runtime.devices.count:
            reason = f"needs {size} devices, {runtime.devices.count} available"
            item.add_marker(pytest.mark.skip(reason=reason))
    if not inprocess.on_gang_rank():  # its driver chose the test; the rank collected one module
        selection.select(config, items)
    if runtime.xdist:
        _publish_items(config, items)


def _publish_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tell the controller each item's module, world size and class (xdist sends ids only)."""
    infos = {
        item.nodeid: metadata.ItemInfo(
            metadata.module_of(item.nodeid),
            item.stash.get(WORLD_SIZE, None),
            getattr(getattr(item, "cls", None), "__qualname__", None),
        )
        for item in items
    }
    runtime = config.stash[RUNTIME]
    metadata.write_items(runtime.session_dir, config.workerinput["workerid"], infos)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the zygote before collection when the preloads are known already (configured, or
    remembered from the last session): its imports then overlap with the collection's."""
    config = session.config
    runtime = config.stash[RUNTIME]
    controller = not hasattr(config, "workerinput") and config.getoption("tx", None)
    if controller or config.option.collectonly or runtime.inprocess is not None:
        return
    if runtime.following_imports:
        runtime.follow_too(preload_cache.load(config) or [])
        return
    preload = runtime.early_preload()
    if preload is not None:
        runtime.pool.start_early(preload)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the zygote as soon as a test will need gangs: its imports take seconds."""
    runtime = session.config.stash[RUNTIME]
    if session.config.option.collectonly or runtime.inprocess is not None:
        return
    early = runtime.early_zygote()
    if any(WORLD_SIZE in item.stash for item in session.items):
        if early is not None:
            runtime.pool.adopt(early, os.path.join(runtime.session_dir, HOST_ZYGOTE_LOG))
        runtime.pool.prestart()
        runtime.remember_preload()
    else:
        if early is not None:
            early.close()
        runtime.stop_early_zygote()


# -- running ------------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session: pytest.Session) -> Generator:
    """A measured driver ends its gangs and zygote with the test loop and adds their coverage
    to its own, inside pytest-cov's wrapper: before it combines and reports."""
    try:
        return (yield)
    finally:
        if rank_coverage.targeted():
            session.config.stash[RUNTIME].close()
            rank_coverage.combine_into_driver()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator:
    if WORLD_SIZE in item.stash:
        return (yield)
    with item.config.stash[RUNTIME].home_device_held():
        return (yield)


def dispatch_timeout(item: pytest.Item) -> float:
    """Seconds a test may run on its gang: pytest-timeout's, its timeout marker, or ours."""
    runtime = item.config.stash[RUNTIME]
    timeout = item.stash.get(TIMEOUT, None) or _marker_timeout(item)
    return timeout or runtime.default_timeout()


def _marker_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    return float(value) if value else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout: for tests on gangs the driver owns the timer (it dumps every rank's
    stack); on a gang's rank, no timer (its driver's covers every rank)."""
    runtime = item.config.stash[RUNTIME]
    if inprocess.on_gang_rank():
        return True
    if not runtime.runs_on_ranks(item):
        return None
    item.stash[TIMEOUT] = float(settings.timeout)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    runtime = item.config.stash[RUNTIME]
    return True if inprocess.on_gang_rank() or runtime.runs_on_ranks(item) else None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    runtime = terminalreporter.config.stash.get(RUNTIME, None)
    if runtime is None:
        return
    notes = runtime.notes + (runtime._pool.notes if runtime._pool is not None else [])
    if notes:
        terminalreporter.section("xdist-megatron")
        for note in notes:
            terminalreporter.line(note)


# -- fixtures ---------------------------------------------------------------------------------


def _rank_info(request: pytest.FixtureRequest) -> RankInfo | None:
    """This process's rank on a gang or under torchrun; None in a driver (which is rank 0 of a
    world of 1)."""
    if request.config.stash[RUNTIME].inprocess is None:
        return None
    from .rank import rank_info

    return rank_info()


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This rank's global rank (0 in the driver)."""
    info = _rank_info(request)
    return info.rank if info else 0


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """Number of ranks in the test's gang (1 in the driver)."""
    info = _rank_info(request)
    return info.world_size if info else 1


@pytest.fixture
def local_rank(request: pytest.FixtureRequest) -> int:
    """This rank's index on its host (0 in the driver)."""
    info = _rank_info(request)
    return info.local_rank if info else 0


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Any:
    """torch.device of this rank: its own GPU, or the CPU."""
    info = _rank_info(request)
    if info:
        return info.device
    import torch  # only here: the other rank fixtures must not make a driver import torch

    is_cuda = request.config.stash[RUNTIME].devices.is_cuda
    return torch.device("cuda", 0) if is_cuda else torch.device("cpu")


class GangHandle:
    """The `gang` fixture: call importable functions on every rank of the test's gang."""

    def __init__(self, item: pytest.Item, world_size: int) -> None:
        self._item = item
        self.world_size = world_size
        self._runtime: Runtime = item.config.stash[RUNTIME]
        self._gang: Any = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the per-rank return values in rank order."""
        if self._runtime.inprocess is not None:
            return self._runtime.inprocess.run(fn, *args, **kwargs)
        timeout = _marker_timeout(self._item) or self._runtime.default_timeout()
        module = metadata.module_of(self._item.nodeid)
        pool = self._runtime.pool
        with pool.devices_held(self.world_size):
            self._gang = pool.acquire(self.world_size, module, timeout)
            return self._gang.run(fn, *args, **kwargs)

    def finish(self) -> None:
        """After the test: the per-job cleanup on each rank (a failure retires the gang)."""
        gang, self._gang = self._gang, None
        if gang is None or not gang.alive:
            return
        with self._runtime.pool.devices_held(self.world_size):
            results = gang.execute(CleanupJob(), self._runtime.default_timeout())
        failed = [r for r in results if r.outcome == FAILED]
        if failed:
            raise GangError(
                f"cleanup after the test failed on rank {failed[0].rank}: "
                f"{failed[0].message}\n{failed[0].longrepr}"
            )


@pytest.fixture
def gang(request: pytest.FixtureRequest) -> Generator[GangHandle, None, None]:
    """Run functions on the ranks of the test's gang from a test body that stays in the driver."""
    size = request.node.stash.get(WORLD_SIZE, None)
    if size is None:
        pytest.fail("the gang fixture needs @pytest.mark.world_size(N) on the test", pytrace=False)
    handle = GangHandle(request.node, size)
    yield handle
    handle.finish()
