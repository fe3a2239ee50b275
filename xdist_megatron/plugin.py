"""pytest hooks: options, the world_size marker, rank fixtures, and marked tests run on gangs."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import pickle
import shutil
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Callable, Generator
from typing import Any

import pytest

from . import (
    dist_mode,
    durations,
    layouts,
    markers,
    metadata,
    passthrough,
    placement,
    preload_cache,
    reporting,
)
from .dist_mode import (  # noqa: F401 - pytest finds these hooks on this module
    pytest_configure_node,
    pytest_plugin_registered,
    pytest_xdist_auto_num_workers,
    pytest_xdist_make_scheduler,
    pytest_xdist_setupnodes,
)
from .explain import ExplainSettings
from .gang import BASE_PRELOAD, DEFAULT_TIMEOUT, GangError, default_backend, detect_devices
from .locks import DeviceLocks
from .placement import DeviceSet
from .pool import MODULE_SCOPE, SESSION_SCOPE, GangPool
from .protocol import FAILED, PASSED, SKIPPED, XFAILED, CleanupJob, RankInfo, TestJob
from .reporting import RankFailures, RankFailuresRepr
from .scheduler import INPUT_KEY
from .zygote_client import ZygoteClient, ZygoteError

NATIVE_FIXTURES = ("rank", "world_size", "local_rank", "device")
NOT_PRELOADED = {"pytest", "_pytest", "pluggy", "xdist", "execnet", "xdist_megatron", "py"}

RUNTIME = pytest.StashKey["Runtime"]()
WORLD_SIZE = pytest.StashKey[int]()
NEXT_ITEM = pytest.StashKey["pytest.Item | None"]()
FIXTURE_BLOB = pytest.StashKey[bytes]()
HOST_ZYGOTE_LOG = "zygote.log"  # in the session folder: output of the workers' shared zygote
RESULTS = pytest.StashKey[list]()
TIMEOUT = pytest.StashKey[float]()
ITEMS = pytest.StashKey[list]()
LAYOUT = pytest.StashKey[tuple]()


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
    dist_mode.add_dist_choice(parser)
    parser.addini("megatron_timeout", "default of --megatron-timeout", default=str(DEFAULT_TIMEOUT))
    parser.addini(
        "megatron_preload",
        "modules the zygote imports once for every rank (default: torch, torch.distributed and "
        "the third-party packages the collected test modules imported)",
        type="linelist",
    )
    parser.addini(
        "megatron_gang_scope",
        "session: one gang per world size for the session, reset at module boundaries; "
        "module: a fresh gang for every module",
        default=SESSION_SCOPE,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", markers.MARKER_HELP)
    config.addinivalue_line("markers", layouts.MARKER_HELP)
    config.addinivalue_line(
        "markers", "timeout(seconds): per-test timeout, honoured on gangs as well"
    )
    config.stash[RUNTIME] = Runtime(config)
    # At exit CPython's last collections walk every object torch and megatron allocated: about
    # 2 s per process with megatron.core loaded. Frozen objects are skipped; the language does
    # not promise to finalise objects still alive at exit, and atexit handlers all still run.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    if not hasattr(config, "workerinput"):  # the controller sees every report, workers need not
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
        self.torchrun = passthrough.TorchrunRank() if passthrough.under_torchrun() else None
        self.xdist: dict | None = getattr(config, "workerinput", {}).get(INPUT_KEY)
        self.worker = self.xdist["worker"] if self.xdist else 0
        self._session_dir: str | None = self.xdist["session_dir"] if self.xdist else None
        scope = config.getini("megatron_gang_scope")
        if scope not in (SESSION_SCOPE, MODULE_SCOPE):
            raise pytest.UsageError(f"megatron_gang_scope must be session or module, got {scope!r}")
        self.scope = scope
        self._devices: DeviceSet | None = None
        self._pool: GangPool | None = None
        self._host_zygote: ZygoteClient | None = None
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
        if self.torchrun is not None:
            return self.torchrun.world_size
        return self.devices.count

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
            )
        return self._pool

    def host_zygote(self) -> str:
        """In the xdist controller: the address of the zygote every worker shares, started on
        first use with the configured preloads (each worker adds the ones it detected)."""
        if self._host_zygote is None:
            quiet = self.config.getoption("capture") != "no"
            log = os.path.join(self.session_dir, HOST_ZYGOTE_LOG)
            with open(log, "ab") if quiet else contextlib.nullcontext() as output:
                self._host_zygote = ZygoteClient(
                    self.early_preload() or list(BASE_PRELOAD),
                    output,
                    address=f"xdist-megatron-{os.getpid()}-{uuid.uuid4().hex[:12]}",
                    cuda=self.devices.is_cuda,
                )
        return self._host_zygote.address

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
        value = self.config.getoption("megatron_timeout")
        return float(value if value is not None else self.config.getini("megatron_timeout"))

    def preload(self) -> list[str]:
        """megatron_preload, or the third-party modules the collected test modules imported."""
        configured = self.config.getini("megatron_preload")
        if configured:
            return list(dict.fromkeys([*BASE_PRELOAD, *configured]))
        items = self.config.stash.get(ITEMS, [])
        found = _third_party_imports(items, str(self.config.rootpath))
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

    def stop_early_zygote(self) -> None:
        if self._pool is not None:
            self._pool.stop_zygote()

    def close(self) -> None:
        if self._pool is not None:
            self.notes += self._pool.notes
            self._pool.close()
            self._pool = None
        if self._host_zygote is not None:
            self._host_zygote.close()
            self._host_zygote = None
        if not self.xdist and self._session_dir is not None:  # workers use the controller's
            shutil.rmtree(self._session_dir, ignore_errors=True)
            self._session_dir = None


def _third_party_imports(items: list[pytest.Item], rootdir: str) -> list[str]:
    """Modules the collected test modules imported that are third-party code (see
    `_is_third_party`)."""
    found: set[str] = set()
    test_modules = {id(m): m for m in (getattr(i, "module", None) for i in items) if m is not None}
    for module in test_modules.values():
        for value in list(vars(module).values()):
            if isinstance(value, type(sys)):
                source = value.__name__
            else:
                source = getattr(value, "__module__", None)
            if isinstance(source, str):
                found |= _preloadable(source, rootdir)
    return sorted(found)


def _preloadable(module_name: str, rootdir: str) -> set[str]:
    """The module if it is third-party code; for a namespace package (`import megatron.core`
    binds `megatron`, which has no file), its imported third-party children."""
    if module_name.partition(".")[0] in NOT_PRELOADED:
        return set()
    module = sys.modules.get(module_name)
    if getattr(module, "__file__", None):
        return {module_name} if _is_third_party(module, rootdir) else set()
    depth = module_name.count(".") + 1
    return {
        name
        for name, child in list(sys.modules.items())
        if name.startswith(module_name + ".")
        and name.count(".") == depth
        and _is_third_party(child, rootdir)
    }


def _is_third_party(module: Any, rootdir: str) -> bool:
    """Installed code: in a site-packages folder, or outside both the project (the rootdir) and
    the standard library (a `pip install --target` folder or a vendored tree on PYTHONPATH)."""
    path = getattr(module, "__file__", None)
    if not path:
        return False
    if "site-packages" in path or "dist-packages" in path:
        return True
    path = os.path.realpath(path)
    return not any(_inside(path, folder) for folder in {*_stdlib(), os.path.realpath(rootdir)})


@functools.cache
def _stdlib() -> frozenset[str]:
    """The standard library's folders (asked once, not for every imported name)."""
    return frozenset(os.path.realpath(sysconfig.get_path(n)) for n in ("stdlib", "platstdlib"))


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


# -- collection -------------------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker(markers.MARKER) is None:
        return
    runtime = metafunc.config.stash[RUNTIME]
    try:
        markers.parametrize_sizes(metafunc, runtime.device_count)
        layout_marker = metafunc.definition.get_closest_marker(layouts.MARKER)
        if layout_marker is not None:
            layouts.layout_of(layout_marker, metafunc.definition.nodeid)
    except (markers.MarkerError, layouts.LayoutError) as exc:
        raise pytest.Collector.CollectError(str(exc)) from None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    runtime = config.stash[RUNTIME]
    config.stash[ITEMS] = items
    for item in items:
        if item.get_closest_marker(markers.MARKER) is None:
            continue
        size = markers.item_world_size(item, runtime.device_count)
        item.stash[WORLD_SIZE] = size
        layout_marker = item.get_closest_marker(layouts.MARKER)
        if layout_marker is not None:
            item.stash[LAYOUT] = layouts.layout_of(layout_marker, item.nodeid)
        if runtime.torchrun is not None:
            if size != runtime.torchrun.world_size:
                reason = f"needs world size {size}, torchrun started {runtime.torchrun.world_size}"
                item.add_marker(pytest.mark.skip(reason=reason))
            continue
        if size > runtime.devices.count:
            reason = f"needs {size} devices, {runtime.devices.count} available"
            item.add_marker(pytest.mark.skip(reason=reason))
        elif runs_on_ranks(item):
            _move_xunit_to_ranks(item)
    if runtime.xdist:
        _publish_items(config, items)


def _publish_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tell the controller each item's module, world size and class (xdist sends ids only)."""
    infos = {
        item.nodeid: metadata.ItemInfo(
            item.nodeid.split("::")[0],
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
    if controller or config.option.collectonly or runtime.torchrun is not None:
        return
    preload = runtime.early_preload()
    if preload is not None:
        runtime.pool.start_early(preload)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the zygote as soon as a test will need gangs: its imports take seconds."""
    runtime = session.config.stash[RUNTIME]
    if session.config.option.collectonly or runtime.torchrun is not None:
        return
    if any(WORLD_SIZE in item.stash for item in session.items):
        runtime.pool.prestart()
        runtime.remember_preload()
    else:
        runtime.stop_early_zygote()


def runs_on_ranks(item: pytest.Item) -> bool:
    """A marked test whose body runs on the ranks (it does not request the `gang` fixture)."""
    return (
        WORLD_SIZE in item.stash
        and isinstance(item, pytest.Function)
        and "gang" not in item.fixturenames
        and item.config.stash[RUNTIME].torchrun is None
    )


def _move_xunit_to_ranks(item: pytest.Item) -> None:
    """setup/teardown_method and _class of the test's class run on the ranks, not here."""
    prefixes = ("_xunit_setup_method_fixture_", "_xunit_setup_class_fixture_")
    item.fixturenames[:] = [n for n in item.fixturenames if not n.startswith(prefixes)]


# -- running ----------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    item.stash[NEXT_ITEM] = nextitem
    if WORLD_SIZE in item.stash:
        return (yield)
    with item.config.stash[RUNTIME].home_device_held():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator:
    runtime = item.config.stash[RUNTIME]
    result = yield  # fixtures set up, skip markers evaluated: the test will run
    if runtime.torchrun is not None and WORLD_SIZE in item.stash:
        runtime.torchrun.before_test(item.module.__name__, item.stash.get(LAYOUT, None))
    if runs_on_ranks(item):
        item.stash[FIXTURE_BLOB] = _fixture_blob(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator:
    result = yield
    runtime = item.config.stash[RUNTIME]
    if runtime.torchrun is not None and WORLD_SIZE in item.stash:
        runtime.torchrun.after_test()
    return result


def _fixture_blob(item: pytest.Function) -> bytes:
    values = {}
    for name in item._fixtureinfo.argnames:
        if name in NATIVE_FIXTURES:
            continue
        value = item.funcargs[name]
        try:
            pickle.dumps(value)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            pytest.fail(
                f"fixture {name!r} of {item.nodeid} cannot be sent to the ranks: it does not "
                f"pickle ({error}). Create the value on the ranks instead: "
                "build it in the test body or in a module-level helper the test calls (the "
                "rank, world_size, local_rank and device fixtures are available there).",
                pytrace=False,
            )
        values[name] = value
    return pickle.dumps(values)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not runs_on_ranks(pyfuncitem):
        return None
    runtime = pyfuncitem.config.stash[RUNTIME]
    timeout = pyfuncitem.stash.get(TIMEOUT, None) or _marker_timeout(pyfuncitem)
    timeout = timeout or runtime.default_timeout()
    size = pyfuncitem.stash[WORLD_SIZE]
    runtime.trim_gangs(size)
    try:
        results = runtime.pool.run(size, pyfuncitem.module.__name__, _test_job(pyfuncitem), timeout)
    except (GangError, ZygoteError) as exc:  # no gang: say why, without our own frames
        pytest.fail(str(exc), pytrace=False)
    pyfuncitem.stash[RESULTS] = results
    verdict = reporting.merge(results)
    if verdict.outcome == PASSED:
        return True
    if verdict.outcome == SKIPPED:
        pytest.skip(verdict.message)
    if verdict.outcome == XFAILED:
        pytest.xfail(verdict.message)
    raise RankFailures(verdict)


def _test_job(item: pytest.Function) -> TestJob:
    nextitem = item.stash.get(NEXT_ITEM, None)
    same_class_next = (
        nextitem is not None
        and getattr(nextitem, "cls", None) is item.cls
        and nextitem.stash.get(WORLD_SIZE, None) == item.stash[WORLD_SIZE]
    )
    config = item.config
    return TestJob(
        nodeid=item.nodeid,
        module_name=item.module.__name__,
        module_path=str(item.path),
        sys_path=list(sys.path),
        class_path=item.cls.__qualname__ if item.cls is not None else None,
        function_name=item.originalname,
        fixtures=item.stash[FIXTURE_BLOB],
        native_names=tuple(n for n in item._fixtureinfo.argnames if n in NATIVE_FIXTURES),
        tbstyle=config.getoption("tbstyle", "auto"),
        showlocals=bool(config.getoption("showlocals", False)),
        capture=config.getoption("capture", "fd") != "no",
        teardown_class=item.cls is not None and not same_class_next,
        layout=item.stash.get(LAYOUT, None),
        explain=ExplainSettings.from_config(config),
    )


def _marker_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    return float(value) if value else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout: for tests on gangs we own the timer (it dumps every rank's stack)."""
    if not runs_on_ranks(item):
        return None
    item.stash[TIMEOUT] = float(settings.timeout)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if runs_on_ranks(item) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator:
    report = yield
    results = item.stash.get(RESULTS, None)
    if call.when != "call" or results is None:
        return report
    report.sections.extend(reporting.output_sections(results, "call"))
    error = call.excinfo.value if call.excinfo is not None else None
    path, lineno, _ = item.reportinfo()
    location = (str(path), (lineno or 0) + 1)
    if isinstance(error, RankFailures):
        report.longrepr = RankFailuresRepr(error.verdict, results, location)
    elif report.skipped and not hasattr(report, "wasxfail"):
        report.longrepr = (*location, f"Skipped: {error.msg if error else ''}")
    return report


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


def _torchrun_info(request: pytest.FixtureRequest) -> RankInfo | None:
    """This process's rank under torchrun; None in a driver (which is rank 0 of a world of 1)."""
    torchrun = request.config.stash[RUNTIME].torchrun
    return torchrun.info if torchrun is not None else None


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This rank's global rank (0 in the driver)."""
    info = _torchrun_info(request)
    return info.rank if info else 0


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """Number of ranks in the test's gang (1 in the driver)."""
    info = _torchrun_info(request)
    return info.world_size if info else 1


@pytest.fixture
def local_rank(request: pytest.FixtureRequest) -> int:
    """This rank's index on its host (0 in the driver)."""
    info = _torchrun_info(request)
    return info.local_rank if info else 0


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Any:
    """torch.device of this rank: its own GPU, or the CPU."""
    info = _torchrun_info(request)
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
        if self._runtime.torchrun is not None:
            return self._runtime.torchrun.run(fn, *args, **kwargs)
        timeout = _marker_timeout(self._item) or self._runtime.default_timeout()
        module = self._item.module.__name__
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
