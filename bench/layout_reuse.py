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
zygote and starts the gang.

Run `python bench/layout_reuse.py --help` for the options. Progress goes to stderr, the table to
stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from typing import Any

from _util import command_line, header_lines, machine, summarize, table, write_json

SUITE_FILE = "test_layout.py"
CPU_SLOTS = 8
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


class BenchmarkError(RuntimeError):
    """The generated suite did not behave; the message says what happened."""


@dataclass(frozen=True)
class Settings:
    tests: int
    world_size: int
    tp: int
    pp: int
    json_path: str | None


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


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=40, help="tests per variant (default 40)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    args = parser.parse_args(argv)
    settings = Settings(args.tests, args.world_size, args.tp, args.pp, args.json)
    problem = invalid(settings)
    if problem:
        parser.error(problem)
    return settings


def invalid(settings: Settings) -> str | None:
    """Why Megatron or the statistics would reject these settings, or None."""
    if settings.tests < 3:
        return "--tests must be >= 3 (the first test is left out, percentiles need two more)"
    if min(settings.world_size, settings.tp, settings.pp) < 1:
        return "--world-size, --tp and --pp must be >= 1"
    if settings.world_size % (settings.tp * settings.pp):
        return f"--world-size {settings.world_size} is not a multiple of tp * pp"
    if importlib.util.find_spec("megatron.core") is None:
        return "megatron.core is not importable: install megatron-core"
    return None


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- devices --------------------------------------------------------------------------------------


def device_options(world_size: int) -> tuple[list[str], str]:
    """pytest options choosing the devices, and how to describe them in the header.

    GPUs: the plugin's default (every visible GPU, NCCL). CPU: enough gloo slots for the gang.
    """
    import torch

    gpus = torch.cuda.device_count()  # counts without creating a CUDA context in this process
    if gpus:
        if gpus < world_size:
            raise BenchmarkError(f"world size {world_size} needs {world_size} GPUs, {gpus} visible")
        return [], f"{gpus} visible GPUs (cpu:gloo,cuda:nccl; tensors on CUDA)"
    slots = max(CPU_SLOTS, world_size)
    return [f"--megatron-devices=cpu:{slots}"], f"cpu:{slots} (gloo)"


# -- one variant ----------------------------------------------------------------------------------


def write_suite(folder: str, variant: Variant, settings: Settings) -> None:
    """The variant's tests in one module, so no module-boundary reset happens between them."""
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")  # the folder is the rootdir: no outer configuration applies
    tests = (
        variant.template.format(
            index=index, world_size=settings.world_size, tp=settings.tp, pp=settings.pp
        )
        for index in range(settings.tests)
    )
    with open(os.path.join(folder, SUITE_FILE), "w") as f:
        f.write(SUITE_HEAD + "".join(tests))


def run_suite(folder: str, variant: Variant, options: list[str], tests: int) -> tuple[str, float]:
    """Run the suite once as a user would; return the junit XML path and the wall time."""
    junit = os.path.join(folder, "junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={junit}", *options, SUITE_FILE]
    progress(f"{variant.name}: {tests} tests: python {' '.join(command[1:])}")
    start = time.perf_counter()
    result = subprocess.run(
        command,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_BASE_S + RUN_TIMEOUT_PER_TEST_S * tests,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise BenchmarkError(f"the {variant.name} suite failed (exit {result.returncode}):\n{tail}")
    return junit, wall


def junit_seconds(path: str, expected: int) -> list[float]:
    """Per-test seconds (setup + call + teardown) in run order; every test must have passed."""
    cases = list(ElementTree.parse(path).getroot().iter("testcase"))
    for case in cases:
        if any(case.find(tag) is not None for tag in ("failure", "error", "skipped")):
            raise BenchmarkError(f"{case.get('name')} did not pass; see {path}")
    if len(cases) != expected:
        raise BenchmarkError(f"expected {expected} tests in {path}, found {len(cases)}")
    return [float(case.get("time", "nan")) for case in cases]


def measure(variant: Variant, settings: Settings, options: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"layout-reuse-{variant.name}-") as folder:
        write_suite(folder, variant, settings)
        junit, wall = run_suite(folder, variant, options, settings.tests)
        seconds = junit_seconds(junit, settings.tests)
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
    devices: str,
    results: list[dict[str, Any]],
    comparison: dict[str, Any],
) -> str:
    lines = header_lines("xdist-megatron benchmark: Megatron layout reuse", info)
    lines += [
        f"devices : {devices}",
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
    settings = parse_args(argv)
    info = machine()
    options, devices = device_options(settings.world_size)
    results = [measure(variant, settings, options) for variant in VARIANTS]
    comparison = compare(*results)
    print(report(settings, info, devices, results, comparison))
    if settings.json_path:
        record = {
            "machine": info,
            "command": command_line(),
            "devices": devices,
            "settings": asdict(settings),
            "variants": results,
            "comparison": comparison,
        }
        write_json(settings.json_path, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
