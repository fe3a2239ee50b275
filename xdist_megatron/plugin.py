"""pytest hooks of xdist-megatron: its options, and whether the run uses it at all.

pytest loads this module (the plugin's entry point) in every run of an environment that has the
plugin installed. A run that uses none of it goes as if it were not installed (DESIGN, invariant
6): this module imports little, adds the options (and `megatron` to xdist's `--dist`) and the
markers' help, and watches collection; nothing starts, nothing of pytest is replaced, nothing is
written, the header says nothing (the Ctrl-C latch of interrupts.py waits for a SIGINT alone).
A run uses the plugin where that is known before the conftest files load (`early_cache.decide`:
its options, its ini, the record of the last runs' tests on gangs), or from the moment
collection finds a test marked for a gang or one that requests a rank fixture no one else
defines. From then on `engage.py` builds the runtime of the process's role (`roles.py`): the
controller's (`controller/runtime.py`), a driver's with its hooks (`driver/runtime_hooks.py`) or
a rank's (`ranks/inprocess.py`); known early, the zygote starts as the conftest files import
torch.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import layouts, markers, roles
from .ci import durations, early_cache, selection
from .driver.timeouts import DEFAULT_TIMEOUT
from .engage import CONTROLLER_PLUGIN, FIXTURES_PLUGIN, RUNTIME, engage
from .harnesses import deepspeed as deepspeed_harness
from .harnesses import device_view, on_gangs
from .harnesses import modelopt as modelopt_harness
from .harnesses import pytorch as pytorch_harness
from .protocol import DIST_MODE, INPUT_KEY
from .report import run_report
from .roles import Role, role_of

pytest_plugins = [  # in this order: each imports no later one, so pytest rewrites them all
    "xdist_megatron.coverage.torchrun_coverage",  # its hooks must precede pytest-cov's
    "xdist_megatron.driver.import_follower",  # starts in the same hook as pytest-cov, after it
    # Ctrl-C is never lost, also while the conftest files import (before collection tells
    # whether the run has gangs); it acts on Ctrl-C alone.
    "xdist_megatron.driver.interrupts",
]
RANK_FIXTURES = ("rank", "world_size", "local_rank", "device", "gang")  # driver/fixtures.py's
TIMEOUT_HELP = "timeout(seconds): per-test timeout, honoured on gangs as well"
DIST_HELP = (
    "megatron: tests marked with a world size run on rank gangs, grouped by (module, world "
    "size), largest first, on device blocks that at most --megatron-gangs-per-device gangs share "
    "(xdist-megatron)."
)

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
        default="session",  # driver/gang_slot.py's SESSION_SCOPE, not imported where unused
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
    is the run known to use the plugin? If so, the hooks needed before `pytest_configure`: the
    xdist controller's (its `-n auto`), and the fixtures, registered before the conftest files'
    (a conftest's fixture of the same name overrides the plugin's). A worker whose CUDA view is
    its home GPU imports a spawn harness counting the run's devices."""
    device_view.follow_harness_imports()
    if early_cache.decide(early_config, parser):
        if not roles.started_as().is_rank:
            early_config.pluginmanager.import_plugin(CONTROLLER_PLUGIN)
        early_config.pluginmanager.import_plugin(FIXTURES_PLUGIN)


def pytest_cmdline_main(config: pytest.Config) -> None:
    """After xdist's (tryfirst) has decided whether workers start: which process this is."""
    roles.decide(config)


def pytest_configure(config: pytest.Config) -> None:
    for line in (markers.MARKER_HELP, markers.EXCLUSIVE_HELP, layouts.MARKER_HELP, TIMEOUT_HELP):
        config.addinivalue_line("markers", line)
    # A worker of a controller that uses the plugin uses it: they decide alike (the same command
    # line, ini and cache), unless another session wrote the cache in between.
    coordinated = INPUT_KEY in getattr(config, "workerinput", {})
    if early_cache.uses_plugin(config) or coordinated:
        engage(config)
    # The controller sees every report, workers need not; a gang's rank reports to its driver.
    if role_of(config) not in (Role.WORKER, Role.GANG_RANK):
        recorder = durations.DurationRecorder(config, lambda: RUNTIME in config.stash)
        config.pluginmanager.register(recorder, "xdist-megatron-durations")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One item per world size; the first marked test engages a run not yet known to use the
    plugin, which then starts its zygote (collection goes on beside its imports)."""
    if deepspeed_harness.owns(metafunc.cls):  # its world_size mark is the harness's
        return deepspeed_harness.parametrize(metafunc)
    runtime = metafunc.config.stash.get(RUNTIME, None)
    if runtime is None:
        if not _marked(metafunc.definition):
            return
        runtime = engage(metafunc.config, follow=True)
    from .driver import collection

    collection.parametrize(metafunc, runtime)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    runtime = config.stash.get(RUNTIME, None)
    if runtime is None:
        if not (
            any(_marked(item) or _requests_rank_fixture(item) for item in items)
            or any(pytorch_harness.recognised(item) for item in items)
            or any(deepspeed_harness.recognised(item) for item in items)
            or modelopt_harness.recognised(config)
        ):
            return
        runtime = engage(config, follow=True)
    from .driver import collection

    if not role_of(config).is_rank:  # a harness's parent side runs in the driver
        pytorch_harness.assign(config, items, runtime)
        deepspeed_harness.assign(config, items, runtime)
        modelopt_harness.install(config, runtime)
    collection.assign(config, items, runtime)


def pytest_report_header(config: pytest.Config) -> str | None:
    if RUNTIME not in config.stash:
        return None
    from .controller import hooks as xdist_hooks

    if xdist_hooks.AUTO_SERIAL in config.stash:
        return f"xdist-megatron: {config.stash[xdist_hooks.AUTO_SERIAL]}"
    if xdist_hooks.requested(config) and role_of(config) is Role.SERIAL:
        return "xdist-megatron: --dist megatron without -n: marked tests run serially on gangs here"
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The plugin's section: what the role's runtime has to say (a rank's has nothing)."""
    notes = getattr(terminalreporter.config.stash.get(RUNTIME, None), "notes", [])
    if notes:
        terminalreporter.section("xdist-megatron")
        for note in notes:
            terminalreporter.line(note)


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
