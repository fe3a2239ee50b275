"""Coverage overhead on the example suite (or `--suite`): each way of running it, without and with
coverage.

  serial    `pytest examples`, then with `--cov=SOURCE --cov-report=` (pytest-cov; the zygote
            and the ranks measured by the plugin, combined into the driver's data);
  xdist     the same with `-n auto --dist megatron`;
  torchrun  `torchrun --standalone --nproc-per-node N -m pytest examples` (the plugin's
            passthrough), then each rank under `coverage run --parallel-mode --source=SOURCE`.

No report is written (pytest-cov's combine is timed, its report is not: it costs the same in every
mode). Where Python >= 3.12, coverage runs with `COVERAGE_CORE=sysmon` (sys.monitoring; `--core`
chooses). SOURCE defaults to megatron.core, the library the examples exercise, else the examples.
The runs of one mode alternate, plain then measured, `--repeat` times; the table gives medians
and their ratio. Needs only pytest-cov, coverage and the plugin (and megatron-core for the full
example suite). `--suite PATH` measures another suite the same ways. On fewer devices
(`--devices`) torchrun starts at most one rank per device, and the report counts the tests each
mode skipped for want of devices or ranks.

Example: python bench/coverage.py --repeat 3 --json bench/out/coverage.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from _util import (
    Devices,
    add_devices_option,
    header_lines,
    importable,
    left_out_line,
    machine,
    resolve_devices,
    run_checked,
    table,
    write_record,
)

INFO = machine()
EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
MODES = ("serial", "xdist", "torchrun")
# pytest -rs lines of tests skipped for want of devices (plugin) or of ranks (torchrun passthrough)
SHORT_OF = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (needs (?:\d+ devices|world size \d+).*)$")


@dataclass(frozen=True)
class Plan:
    """What every run shares."""

    suite: str
    source: str
    nproc: int
    core: str | None
    devices: Devices


def default_source() -> str:
    return "megatron.core" if importable("megatron.core") else EXAMPLES


def command(mode: str, measured: bool, plan: Plan) -> list[str]:
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", plan.suite]
    if mode == "torchrun":
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.nproc}"]
        if measured:
            launch += ["-m", "coverage", "run", "--parallel-mode", f"--source={plan.source}"]
        return [sys.executable, *launch, *pytest_args]
    extra = ["-n", "auto", "--dist", "megatron"] if mode == "xdist" else []
    cov = [f"--cov={plan.source}", "--cov-report="] if measured else []
    return [sys.executable, *pytest_args, *plan.devices.plugin_options(), *extra, *cov]


def timed_run(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds and output of one run, in a fresh folder (its data files go there)."""
    with tempfile.TemporaryDirectory(prefix="bench-coverage-") as cwd:
        return run_checked(argv, cwd, env=env)


def run_env(mode: str, measured: bool, plan: Plan) -> dict[str, str]:
    """torchrun's ranks see only the devices given (the plugin places its own ranks)."""
    env = dict(os.environ)
    if plan.core and measured:
        env["COVERAGE_CORE"] = plan.core
    if mode == "torchrun":
        env.update(plan.devices.visible_env())
    return env


def skipped_short(output: str) -> list[str]:
    """'N tests: reason' for the tests a run skipped for want of devices or ranks."""
    counts: Counter[str] = Counter()
    for line in output.splitlines():
        found = SHORT_OF.match(line.strip())
        if found:
            counts[found.group(2)] += int(found.group(1))
    return [f"{n} tests: {reason}" for reason, n in sorted(counts.items())]


def measure(modes: list[str], repeat: int, plan: Plan) -> tuple[dict, list[str]]:
    """Each mode's samples, and what the first plain run of each mode left out."""
    results: dict[str, dict[str, list[float]]] = {}
    left_out = []
    for mode in modes:
        samples: dict[str, list[float]] = {"plain": [], "coverage": []}
        for attempt in range(repeat):
            for kind, measured in (("plain", False), ("coverage", True)):
                argv = command(mode, measured, plan)
                seconds, output = timed_run(argv, run_env(mode, measured, plan))
                samples[kind].append(seconds)
                print(f"  {mode:8} {kind:8} {seconds:6.1f} s", flush=True)
                if attempt == 0 and not measured:
                    left_out += [f"{mode}: {note}" for note in skipped_short(output)]
        results[mode] = samples
    return results, left_out


def fit_nproc(nproc: int, devices: Devices) -> tuple[int, list[str]]:
    """torchrun's ranks per node: at most one per device."""
    if nproc <= devices.count:
        return nproc, []
    note = f"torchrun --nproc-per-node {nproc}: {devices.shortfall(nproc)}; ran {devices.count}"
    return devices.count, [note]


def rows(results: dict) -> list[list[str]]:
    out = []
    for mode, samples in results.items():
        plain = statistics.median(samples["plain"])
        measured = statistics.median(samples["coverage"])
        out.append([mode, f"{plain:.1f}", f"{measured:.1f}", f"{measured / plain:.2f}x"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default=EXAMPLES, help="the tests (default: the examples)")
    parser.add_argument("--source", default=default_source(), help="what --cov measures")
    parser.add_argument("--nproc", type=int, default=2, help="torchrun's ranks per node")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    sysmon = "sysmon" if sys.version_info >= (3, 12) else None
    parser.add_argument("--core", default=sysmon, help="COVERAGE_CORE of the measured runs")
    parser.add_argument("--json", help="write the samples here")
    add_devices_option(parser)
    args = parser.parse_args()
    devices = resolve_devices(args.devices)
    modes = args.modes.split(",")
    nproc, fitted = fit_nproc(args.nproc, devices) if "torchrun" in modes else (args.nproc, [])
    suite = os.path.abspath(args.suite)
    plan = Plan(suite, args.source, nproc, args.core, devices)
    print("\n".join(header_lines(f"coverage overhead on {suite}", INFO)))
    print(f"source  : {args.source}; COVERAGE_CORE={args.core or '(coverage default)'}")
    print(f"devices : {devices.describe()}", flush=True)
    results, skipped = measure(modes, args.repeat, plan)
    print(left_out_line(fitted + skipped))
    print(table(["mode", "plain s", "--cov s", "overhead"], rows(results)))
    write_record(
        args.json, INFO, suite=suite, source=args.source, core=args.core, **results,
        devices=devices.spec, left_out=fitted + skipped,
    )  # fmt: skip


if __name__ == "__main__":
    main()
