"""pytest hooks of xdist-megatron: its options, and whether the run uses it at all.

pytest loads this module (the plugin's entry point) in every run of an environment that has the
plugin installed. A run that uses none of it goes as if it were not installed (DESIGN, invariant
6): this module imports little, adds the options (and `megatron` to xdist's `--dist`) and the
markers' help, and watches collection; nothing starts, nothing of pytest is replaced, nothing is
written, the header says nothing (the Ctrl-C latch of interrupts.py waits for a SIGINT alone).
A run uses the plugin where that is known before the conftest files load (`early_cache.decide`:
its options, its ini, the record of the last runs' tests on gangs), or from the moment
collection finds a test marked for a gang or one that requests a rank fixture no one else
defines. From then on `_engage` registers the role's hook modules (`driver/runtime_hooks.py`,
the fixtures, the xdist hooks) and builds the process's Runtime; known early, the zygote starts
as the conftest files import torch.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from . import layouts, markers
from .ci import durations, early_cache, selection
from .driver.timeouts import DEFAULT_TIMEOUT
from .harnesses import deepspeed as deepspeed_harness
from .harnesses import device_view, on_gangs
from .harnesses import modelopt as modelopt_harness
from .harnesses import pytorch as pytorch_harness
from .protocol import DIST_MODE, INPUT_KEY, on_gang_rank
from .report import run_report

if TYPE_CHECKING:
    from .driver.runtime import Runtime

pytest_plugins = [  # in this order: each imports no later one, so pytest rewrites them all
    "xdist_megatron.coverage.torchrun_coverage",  # its hooks must precede pytest-cov's
    "xdist_megatron.driver.import_follower",  # starts in the same hook as pytest-cov, after it
    # Ctrl-C is never lost, also while the conftest files import (before collection tells
    # whether the run has gangs); it acts on Ctrl-C alone.
    "xdist_megatron.driver.interrupts",
]
ROLE_PLUGINS = (
    "xdist_megatron.driver.runtime_hooks",
    "xdist_megatron.controller.hooks",
    "xdist_megatron.driver.fixtures",
)
RANK_FIXTURES = ("rank", "world_size", "local_rank", "device", "gang")  # driver/fixtures.py's
TIMEOUT_HELP = "timeout(seconds): per-test timeout, honoured on gangs as well"
DIST_HELP = (
    "megatron: tests marked with a world size run on rank gangs, grouped by (module, world "
    "size), largest first, on device blocks that at most --megatron-gangs-per-device gangs share "
    "(xdist-megatron)."
)

_ROLE = pytest.StashKey[ModuleType]()  # runtime_hooks, once the run is known to use the plugin
_parser: pytest.Parser | None = None


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
    group.addoption(
        "--megatron-gangs-per-device",
        type=int,
        default=None,
        help="at most K gangs hold a device at once, across workers and sessions sharing the "
        "lock folder; -n auto starts K workers per device (default: ini "
        "megatron_gangs_per_device, 1).",
    )
    group.addoption(
        "--megatron-harnesses",
        choices=on_gangs.MODES,
        default=None,
        help="auto: tests of harnesses that spawn processes per test (PyTorch's "
        "MultiProcessTestCase family, Model-Optimizer's spawn_multiprocess_job) run their "
        "children's part on gangs; off: they spawn as without the plugin (default: ini "
        "megatron_harnesses, auto).",
    )
    selection.add_options(group, parser)
    durations.add_options(group, parser)
    run_report.add_options(group)
    _add_dist_choice(parser)
    parser.addini("megatron_timeout", "default of --megatron-timeout", default=str(DEFAULT_TIMEOUT))
    parser.addini("megatron_world_size", "default of --megatron-world-size", default="")
    parser.addini(
        "megatron_gangs_per_device", "default of --megatron-gangs-per-device", default="1"
    )
    parser.addini(
        "megatron_preload",
        "modules the zygote imports once for every rank, at its start (default: torch, "
        "torch.distributed and the library packages the driver imports, as it imports them)",
        type="linelist",
    )
    parser.addini("megatron_harnesses", "default of --megatron-harnesses", default="auto")
    parser.addini(
        "megatron_gang_scope",
        "session: one gang per world size for the session, reset at module boundaries; "
        "module: a fresh gang for every module",
        default="session",  # driver/pool.py's SESSION_SCOPE, not imported where unused
    )


def _add_dist_choice(parser: pytest.Parser) -> None:
    """Add `megatron` to xdist's `--dist` choices, whichever of the two plugins loaded first
    (from a conftest it would come too late: the choices must be there before parsing)."""
    global _parser
    _parser = parser
    for group in parser._groups:
        for option in group.options:
            if "--dist" not in option.names():
                continue
            attrs = option.attrs()
            choices = attrs.get("choices")
            if choices is not None and DIST_MODE not in choices:
                choices.append(DIST_MODE)
                attrs["help"] = f"{attrs.get('help') or ''} {DIST_HELP}"
                option.help = attrs["help"]  # older pytest rebuilds attrs() from this


def pytest_plugin_registered(plugin: Any, plugin_name: str, manager: Any) -> None:
    if _parser is not None and getattr(plugin, "__name__", None) == "xdist.plugin":
        _add_dist_choice(_parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    """Before the conftest files load (and the zygote's start beside them, import_follower.py):
    is the run known to use the plugin? If so, its role's hook modules from now on. A worker
    whose CUDA view is its home GPU imports a spawn harness counting the run's devices."""
    device_view.follow_harness_imports()
    if early_cache.decide(early_config, parser):
        _register_role_plugins(early_config)


def pytest_configure(config: pytest.Config) -> None:
    for line in (markers.MARKER_HELP, markers.EXCLUSIVE_HELP, layouts.MARKER_HELP, TIMEOUT_HELP):
        config.addinivalue_line("markers", line)
    # A worker of a controller that uses the plugin uses it: they decide alike (the same command
    # line, ini and cache), unless another session wrote the cache in between.
    coordinated = INPUT_KEY in getattr(config, "workerinput", {})
    if early_cache.uses_plugin(config) or coordinated:
        _engage(config)
    # The controller sees every report, workers need not; a gang's rank reports to its driver.
    if not hasattr(config, "workerinput") and not on_gang_rank():
        recorder = durations.DurationRecorder(config, lambda: _ROLE in config.stash)
        config.pluginmanager.register(recorder, "xdist-megatron-durations")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One item per world size; the first marked test engages a run not yet known to use the
    plugin, which then starts its zygote (collection goes on beside its imports)."""
    if deepspeed_harness.owns(metafunc.cls):  # its world_size mark is the harness's
        return deepspeed_harness.parametrize(metafunc)
    role = metafunc.config.stash.get(_ROLE, None)
    if role is None:
        if not _marked(metafunc.definition):
            return
        role = _engage(metafunc.config, follow=True)
    role.parametrize(metafunc)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    role = config.stash.get(_ROLE, None)
    if role is None:
        if not (
            any(_marked(item) or _requests_rank_fixture(item) for item in items)
            or any(pytorch_harness.recognised(item) for item in items)
            or any(deepspeed_harness.recognised(item) for item in items)
            or modelopt_harness.recognised(config)
        ):
            return
        role = _engage(config, follow=True)
    from .driver.runtime import RUNTIME

    pytorch_harness.assign(config, items, config.stash[RUNTIME])
    deepspeed_harness.assign(config, items, config.stash[RUNTIME])
    modelopt_harness.install(config, config.stash[RUNTIME])
    role.assign(config, items)


def pytest_report_header(config: pytest.Config) -> str | None:
    if _ROLE not in config.stash:
        return None
    from .controller import hooks as xdist_hooks

    if xdist_hooks.AUTO_SERIAL in config.stash:
        return f"xdist-megatron: {config.stash[xdist_hooks.AUTO_SERIAL]}"
    if xdist_hooks.requested(config) and not config.getoption("tx", None):
        return "xdist-megatron: --dist megatron without -n: marked tests run serially on gangs here"
    return None


def _engage(config: pytest.Config, follow: bool = False) -> ModuleType:
    """From the moment the run is known to use the plugin: its role's hook modules, the
    imports followed for the zygote where that is known only at collection (`follow`), the
    process's Runtime and, in a driver, the plugins that stamp and report its tests."""
    _register_role_plugins(config)
    from .driver import import_follower, runtime_hooks  # after: pytest rewrites its plugins

    config.stash[_ROLE] = runtime_hooks
    if follow:
        import_follower.start(config)
    runtime = runtime_hooks.configure(config)
    if runtime.inprocess is None:
        _register_report_plugins(config, runtime)
    return runtime_hooks


def _register_role_plugins(config: pytest.Config) -> None:
    for name in ROLE_PLUGINS:
        config.pluginmanager.import_plugin(name)  # once; not where `-p no:NAME` blocks it


def _register_report_plugins(config: pytest.Config, runtime: Runtime) -> None:
    """Each test's facts on its reports; the run report only where every report arrives (the
    serial driver or the xdist controller)."""
    from .driver.run_facts import RunFacts

    manager = config.pluginmanager
    manager.register(RunFacts(runtime), "xdist-megatron-run-facts")
    if not hasattr(config, "workerinput"):
        report = run_report.RunReport(config, lambda: runtime.devices.ids)
        manager.register(report, "xdist-megatron-run-report")


def _marked(node: pytest.Item) -> bool:
    """A world_size or megatron marker on the test, its class or its module (not DeepSpeed's
    world_size mark, on its harness's tests)."""
    if deepspeed_harness.owns(getattr(node, "cls", None)):
        return False
    return any(node.get_closest_marker(name) for name in (markers.MARKER, layouts.MARKER))


def _requests_rank_fixture(item: pytest.Item) -> bool:
    """A test that requests a rank fixture (`rank`, `gang`...) that nothing but the plugin
    defines: without the plugin it would fail to find it."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's record of what a test requests
    if info is None:
        return False
    return any(
        name in info.names_closure and name not in info.name2fixturedefs for name in RANK_FIXTURES
    )
