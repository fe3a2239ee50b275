"""What `@pytest.mark.megatron` saves per test by keeping a Megatron layout alive between tests.

Megatron test suites usually call `parallel_state.initialize_model_parallel` in every test body,
so every test builds the layout's process groups again (on GPUs the NCCL communicators, the
expensive part) and the plugin's per-test cleanup destroys them afterwards. With
`@pytest.mark.megatron(tp=..., pp=...)` the plugin builds the layout once and keeps it for the
following tests of that layout on the gang.

The benchmark generates N world_size(W) tests in two variants that differ only in who initialises
the layout; each body does one all_reduce on the tensor-parallel group (on the `device` fixture, so
on GPUs NCCL really creates that communicator). Each variant runs in its own pytest run, and
per-test times come from its junit XML. The first test of each run is left out: it waits for the
zygote and starts the gang. A layout larger than the devices (`--devices`) shrinks to the largest
that fits (tp first, then pp), and the report says what was left out.

Run `python bench/layout_reuse.py --help` for the options. Progress goes to stderr, the table to
stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

from _util import (
    BenchmarkError,
    Devices,
    add_devices_option,
    header_lines,
    importable,
    left_out_line,
    machine,
    passed_times,
    progress,
    resolve_devices,
    run_junit_suite,
    summarize,
    table,
    write_ini,
    write_record,
)

SUITE_FILE = "test_layout.py"
RUN_TIMEOUT_BASE_S = 600.0
RUN_TIMEOUT_PER_TEST_S = 30.0

SUITE_HEAD = '''import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state


def tiny_op(device):
    """All-reduce on the tensor-parallel group; on GPUs its first use creates the communicator."""
    value = torch.ones(1, device=device)
    dist.all_reduce(value, group=parallel_state.get_tensor_model_parallel_group())
    assert value.item() == parallel_state.get_tensor_model_parallel_world_size()
'''

MARKER_TEST = """

@pytest.mark.world_size({world_size})
@pytest.mark.megatron(tp={tp}, pp={pp})
def test_{index:04d}(device):
    tiny_op(device)
"""

PER_TEST_TEST = """

@pytest.mark.world_size({world_size})
def test_{index:04d}(device):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}
    )
    tiny_op(device)
"""


@dataclass(frozen=True)
class Settings:
    tests: int
    world_size: int
    tp: int
    pp: int
    json_path: str | None

    def layout(self) -> str:
        return f"world_size({self.world_size}) tp={self.tp} pp={self.pp}"


@dataclass(frozen=True)
class Variant:
    name: str
    template: str
    description: str


VARIANTS = (
    Variant("marker", MARKER_TEST, "@pytest.mark.megatron: the plugin keeps the layout"),
    Variant("per-test", PER_TEST_TEST, "initialize_model_parallel in the body, destroyed after"),
)


# -- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Settings, str | None]:
    """The settings asked for, and the --devices spec."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=40, help="tests per variant (default 40)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    add_devices_option(parser)
    args = parser.parse_args(argv)
    settings = Settings(args.tests, args.world_size, args.tp, args.pp, args.json)
    problem = invalid(settings)
    if problem:
        parser.error(problem)
    return settings, args.devices


def invalid(settings: Settings) -> str | None:
    """Why Megatron or the statistics would reject these settings, or None."""
    if settings.tests < 3:
        return "--tests must be >= 3 (the first test is left out, percentiles need two more)"
    if min(settings.world_size, settings.tp, settings.pp) < 1:
        return "--world-size, --tp and --pp must be >= 1"
    if settings.world_size % (settings.tp * settings.pp):
        return f"--world-size {settings.world_size} is not a multiple of tp * pp"
    if not importable("megatron.core"):
        return "megatron.core is not importable: install megatron-core"
    return None


# -- devices --------------------------------------------------------------------------------------


def fit_layout(settings: Settings, devices: Devices) -> tuple[Settings, list[str]]:
    """The largest layout of at most the asked sizes that fits the devices: tp shrinks first,
    then pp, then the world size to a multiple of tp * pp; and what was left out."""
    if settings.world_size <= devices.count:
        return settings, []
    world_size = devices.count
    tp = min(settings.tp, world_size)
    pp = min(settings.pp, world_size // tp)
    fitted = replace(settings, world_size=world_size // (tp * pp) * tp * pp, tp=tp, pp=pp)
    note = (
        f"{settings.layout()}: {devices.shortfall(settings.world_size)}; "
        f"measured {fitted.layout()} instead"
    )
    return fitted, [note]


# -- one variant ----------------------------------------------------------------------------------


def write_suite(folder: str, variant: Variant, settings: Settings) -> None:
    """The variant's tests in one module, so no module-boundary reset happens between them."""
    write_ini(folder)
    tests = (
        variant.template.format(
            index=index, world_size=settings.world_size, tp=settings.tp, pp=settings.pp
        )
        for index in range(settings.tests)
    )
    with open(os.path.join(folder, SUITE_FILE), "w") as f:
        f.write(SUITE_HEAD + "".join(tests))


def measure(variant: Variant, settings: Settings, options: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"layout-reuse-{variant.name}-") as folder:
        write_suite(folder, variant, settings)
        label = f"{variant.name}: {settings.tests} tests"
        timeout = RUN_TIMEOUT_BASE_S + RUN_TIMEOUT_PER_TEST_S * settings.tests
        junit, wall = run_junit_suite(folder, SUITE_FILE, options, label, timeout)
        seconds = [s for _, s in passed_times(junit)]
    if len(seconds) != settings.tests:
        raise BenchmarkError(f"expected {settings.tests} tests in {junit}, found {len(seconds)}")
    measured_ms = [s * 1000 for s in seconds[1:]]
    progress(f"{variant.name}: wall {wall:.1f} s, median {summarize(measured_ms)['median']:.1f} ms")
    return {
        "variant": variant.name,
        "description": variant.description,
        "wall_s": wall,
        "first_test_ms": seconds[0] * 1000,
        "total_s": sum(seconds[1:]),
        "per_test_ms": summarize(measured_ms),
    }


# -- comparison and report ------------------------------------------------------------------------


def compare(marker: dict[str, Any], per_test: dict[str, Any]) -> dict[str, Any]:
    """What the marker saves against initialising in every test, per test and over the suite."""
    fast, slow = marker["per_test_ms"], per_test["per_test_ms"]
    return {
        "saving_ms": {q: slow[q] - fast[q] for q in ("median", "p90")},
        "saving_total_s": per_test["total_s"] - marker["total_s"],
        "ratio": {q: slow[q] / fast[q] for q in ("median", "p90")},
        "ratio_total": per_test["total_s"] / marker["total_s"],
    }


def results_table(results: list[dict[str, Any]], comparison: dict[str, Any]) -> str:
    headers = ["variant", "tests", "p50 [ms]", "p90 [ms]", "total [s]", "first [s]", "run [s]"]
    rows = [
        [
            r["variant"],
            str(r["per_test_ms"]["n"]),
            f"{r['per_test_ms']['median']:.1f}",
            f"{r['per_test_ms']['p90']:.1f}",
            f"{r['total_s']:.2f}",
            f"{r['first_test_ms'] / 1000:.2f}",
            f"{r['wall_s']:.1f}",
        ]
        for r in results
    ]
    saving, ratio = comparison["saving_ms"], comparison["ratio"]
    rows.append(
        [
            "saving (per-test - marker)",
            "",
            f"{saving['median']:.1f}",
            f"{saving['p90']:.1f}",
            f"{comparison['saving_total_s']:.2f}",
        ]
    )
    rows.append(
        [
            "ratio (per-test / marker)",
            "",
            f"{ratio['median']:.1f}x",
            f"{ratio['p90']:.1f}x",
            f"{comparison['ratio_total']:.1f}x",
        ]
    )
    return table(headers, [row + [""] * (len(headers) - len(row)) for row in rows])


def report(
    settings: Settings,
    info: dict[str, Any],
    devices: Devices,
    left_out: list[str],
    results: list[dict[str, Any]],
    comparison: dict[str, Any],
) -> str:
    lines = header_lines("xdist-megatron benchmark: Megatron layout reuse", info)
    lines += [
        f"devices : {devices.describe()}",
        left_out_line(left_out),
        f"suite   : {settings.tests} tests per variant, world_size({settings.world_size}), "
        f"tp={settings.tp} pp={settings.pp}; body: all_reduce on the TP group",
        *(f"{r['variant']:<8}: {r['description']}" for r in results),
        "",
        "Per-test time from junit (setup + call + teardown, 1 ms steps), first test left out;",
        "total: their sum; first: the first test (zygote, gang start); run: pytest's wall time",
        results_table(results, comparison),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    asked, spec = parse_args(argv)
    info = machine()
    devices = resolve_devices(spec)
    settings, left_out = fit_layout(asked, devices)
    options = devices.plugin_options()
    results = [measure(variant, settings, options) for variant in VARIANTS]
    comparison = compare(*results)
    print(report(settings, info, devices, left_out, results, comparison))
    write_record(
        settings.json_path, info, devices=devices.spec, left_out=left_out,
        settings=asdict(settings), variants=results, comparison=comparison,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
