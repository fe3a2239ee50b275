"""Small helpers shared by the benchmarks: summary statistics, aligned tables, the machine header,
the devices a benchmark runs on, and running a generated suite under pytest.

No heavy imports: benchmark scripts also run as child processes whose start-up is timed. The
benchmarks import the package's non-public modules only through the functions at the end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from importlib import metadata
from typing import Any

CPU_PREFIX = "cpu:"
MIN_CPU_SLOTS = 8  # the plugin's CPU-mode default: max(8, cores) slots


class BenchmarkError(RuntimeError):
    """A gang or a generated suite did not behave; the message says what happened."""


def progress(message: str) -> None:
    """Progress goes to stderr, so that stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def importable(name: str) -> bool:
    """Whether `name` can be imported here, without importing it (a missing parent is False)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples: list[float]) -> dict[str, float | int | list[float]]:
    """Median, p90, min and max of `samples`, with the samples themselves for the JSON record."""
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "p90": percentile(samples, 90),
        "min": min(samples),
        "max": max(samples),
        "samples": list(samples),
    }


def ratio(numerator: float, denominator: float) -> str:
    """A table cell of two decimals; "-" where there is nothing to divide by (a run that ran no
    test, a row with nothing recorded)."""
    return f"{numerator / denominator:.2f}" if denominator > 0 else "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain-text table: first column left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def package_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str | int]:
    """What the numbers depend on; read from metadata so the header imports nothing heavy."""
    return {
        "cores": os.cpu_count() or 1,
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "megatron-core": package_version("megatron-core"),
        "load": " ".join(f"{load:.2f}" for load in os.getloadavg()),
    }


def command_line() -> str:
    return shlex.join(["python", *sys.argv])


def header_lines(title: str, info: dict[str, str | int]) -> list[str]:
    return [
        title,
        f"machine : {info['cores']} cores, {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, megatron-core {info['megatron-core']}",
        f"load    : {info['load']} (1, 5, 15 min averages at start; other work skews timings)",
        f"command : {command_line()}",
    ]


def write_json(path: str, data: object) -> None:
    """A benchmark's numbers, for docs/benchmarks.md and for comparing runs."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_record(path: str | None, info: dict[str, Any], **parts: Any) -> None:
    """The JSON record of a run (nothing without a path): machine and command first, then the
    benchmark's own parts."""
    if path:
        write_json(path, {"machine": info, "command": command_line(), **parts})


# -- devices --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Devices:
    """The devices a benchmark runs on, as `--megatron-devices` names them ("0,1" or "cpu:8")."""

    spec: str
    ids: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def is_cpu(self) -> bool:
        return self.spec.startswith(CPU_PREFIX)

    def describe(self) -> str:
        if self.is_cpu:
            return f"{self.spec} (gloo)"
        return f"GPUs {self.spec} (cpu:gloo,cuda:nccl)"

    def plugin_options(self) -> list[str]:
        """What the plugin's runs are given, so that they use these devices and no others."""
        return ["--megatron-devices", self.spec]

    def visible_env(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for processes the plugin does not place (torchrun's ranks, spawned
        ones): no GPU on CPU, else the GPUs named, as this process sees them."""
        if self.is_cpu:
            return {"CUDA_VISIBLE_DEVICES": ""}
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        physical = [visible[i] if i < len(visible) else str(i) for i in self.ids]
        return {"CUDA_VISIBLE_DEVICES": ",".join(physical)}

    def fitting(self, sizes: list[int]) -> tuple[list[int], list[str]]:
        """The world sizes that fit, and for each one left out why (the plugin's own words)."""
        kept = [size for size in sizes if size <= self.count]
        notes = [f"ws{size}: {self.shortfall(size)}" for size in sizes if size > self.count]
        return kept, notes

    def shortfall(self, size: int) -> str:
        return f"needs {size} devices, {self.count} available ({self.spec})"


def gpu_count() -> int:
    """Visible CUDA devices, asked in a child so that this process stays light."""
    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip() or 0)


def resolve_devices(spec: str | None) -> Devices:
    """`spec` as `--megatron-devices` takes it; None: every visible GPU, else the plugin's
    CPU-mode default (max(8, cores) slots)."""
    if spec is None:
        gpus = gpu_count()
        spec = ",".join(map(str, range(gpus))) if gpus else f"{CPU_PREFIX}{cpu_slots()}"
    spec = spec.strip()
    if spec == "cpu":
        spec = f"{CPU_PREFIX}{cpu_slots()}"
    try:
        if spec.startswith(CPU_PREFIX):
            ids = tuple(range(int(spec[len(CPU_PREFIX) :])))
        else:
            ids = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise SystemExit(f"--devices {spec!r}: expected '0,1,2' or 'cpu:N'") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise SystemExit(f"--devices {spec!r}: needs at least one device, each named once")
    return Devices(spec, ids)


def cpu_slots() -> int:
    return max(MIN_CPU_SLOTS, os.cpu_count() or 1)


def add_devices_option(parser: Any) -> None:
    """The `--devices` option every benchmark that places ranks takes."""
    parser.add_argument(
        "--devices",
        help="--megatron-devices of the runs: '0,1' or 'cpu:N' (default: every visible GPU, "
        "else cpu:max(8, cores)); what needs more devices is left out, and said so",
    )


def left_out_line(notes: list[str]) -> str:
    """The report's line on what did not fit the devices."""
    return "left out: " + ("; ".join(notes) if notes else "nothing, everything fits")


# -- a generated suite under pytest ---------------------------------------------------------------


def write_ini(folder: str, lines: list[str] | None = None) -> None:
    """A pytest.ini that makes `folder` the rootdir, so no outer configuration applies."""
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n" + "".join(f"{line}\n" for line in lines or []))


def run_checked(
    command: list[str], cwd: str, timeout: float | None = None, env: dict[str, str] | None = None
) -> tuple[float, str]:
    """Run `command` to its end; its wall seconds and stdout. A run that does not exit 0 is a
    BenchmarkError with the end of its output."""
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        output = tail(done.stdout + done.stderr, 40)
        raise BenchmarkError(f"exit {done.returncode}: {shlex.join(command)}\n{output}")
    return seconds, done.stdout


def run_junit_suite(
    folder: str, target: str, options: list[str], label: str, timeout: float
) -> tuple[str, float]:
    """Run pytest on `target` in `folder` as a user would; the junit XML path and the wall time."""
    junit = os.path.join(folder, "junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={junit}", *options, target]
    progress(f"{label}: python {' '.join(command[1:])}")
    wall, _ = run_checked(command, folder, timeout)
    return junit, wall


OUTCOMES = ("passed", "failed", "skipped")
NO_PLUGIN = ["-p", "no:xdist_megatron.plugin"]
# A spawn harness's suite with and without the plugin: its options per mode ({workers}: -n's).
HARNESS_MODES = {
    "plain serial": NO_PLUGIN,
    "plain -n": [*NO_PLUGIN, "-n", "{workers}"],
    "plugin serial": [],
    "plugin -n": ["-n", "{workers}", "--dist", "megatron"],
}


def run_for_outcomes(
    label: str, arguments: list[str], cwd: str, environ: dict[str, str], timeout: float
) -> tuple[float, list[Any]]:
    """Run `pytest ARGUMENTS` in `cwd` with `environ` and a junit file; the wall time and the
    junit's test cases. Exit 1 (some tests failed) is a result, which the caller tabulates."""
    junit = os.path.join(tempfile.mkdtemp(prefix="bench-junit-"), "junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={junit}", *arguments]
    progress(f"{label}: pytest {' '.join(arguments)}")
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise BenchmarkError(
            f"{label}: exit {done.returncode}\n{tail(done.stdout + done.stderr, 40)}"
        )
    return wall, list(ElementTree.parse(junit).getroot().iter("testcase"))


def outcome_of(case: Any) -> str:
    """passed, failed or skipped: a junit test case's outcome (an error counts as failed)."""
    if case.find("skipped") is not None:
        return "skipped"
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "passed"


def counted(outcomes: dict[str, str]) -> str:
    return ", ".join(f"{list(outcomes.values()).count(word)} {word}" for word in OUTCOMES)


def passed_times(path: str) -> list[tuple[str, float]]:
    """(name, seconds of setup + call + teardown) of each test in run order; all must pass."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if any(case.find(tag) is not None for tag in ("failure", "error", "skipped")):
            raise BenchmarkError(f"{name} did not pass; see {path}")
        cases.append((name, float(case.get("time", "nan"))))
    return cases


# -- the package's non-public modules: every import of one is here, their paths follow its layout -


def zygote_client(preload: list[str], log: Any, standby: int, cuda: bool) -> Any:
    """A zygote, started as a driver starts its own (gang_start.py times that start)."""
    from xdist_megatron.driver.zygote_client import ZygoteClient

    return ZygoteClient(preload, log, standby=standby, cuda=cuda)


def device_set(devices: Devices) -> Any:
    """`devices` as Gang's `devices` argument takes them (a placement.DeviceSet)."""
    import torch

    from xdist_megatron import placement

    gpus = 0 if devices.is_cpu else torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return placement.parse_devices(devices.spec, gpus, os.cpu_count() or 1, visible)


def simulator() -> Any:
    """The clocked, process-free simulation of `--dist megatron` (bench/_simulator.py)."""
    import _simulator

    return _simulator


SCHEDULER_PATHS = ("xdist_megatron/controller/scheduler.py", "xdist_megatron/xdist/scheduler.py")


def scheduler_at(revision: str) -> Any:
    """`MegatronScheduling` as it was at git `revision`, loaded beside today's package (its
    imports resolve there), to simulate the scheduler before a change; BenchmarkError when git
    cannot show it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in SCHEDULER_PATHS:  # the newest first: the folder was renamed
        shown = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=root, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    else:
        raise BenchmarkError(f"git show {revision}:{path}: {shown.stderr.strip()}")
    name = f"xdist_megatron.controller.scheduler_at_{revision.replace('-', '_').replace('.', '_')}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "xdist_megatron.controller"
    sys.modules[name] = module
    exec(compile(shown.stdout, f"{revision}:{path}", "exec"), module.__dict__)
    return module.MegatronScheduling
