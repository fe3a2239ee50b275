"""Coverage overhead on the example suite: each way of running it, without and with coverage.

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
example suite).

Example: python bench/coverage.py --repeat 3 --json bench/out/coverage.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import header_lines, machine, table, write_json

INFO = machine()
EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
MODES = ("serial", "xdist", "torchrun")
LOG_TAIL = 15


def default_source() -> str:
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    return "megatron.core" if found else EXAMPLES


def command(mode: str, measured: bool, source: str, nproc: int) -> list[str]:
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", EXAMPLES]
    if mode == "torchrun":
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if measured:
            launch += ["-m", "coverage", "run", "--parallel-mode", f"--source={source}"]
        return [sys.executable, *launch, *pytest_args]
    extra = ["-n", "auto", "--dist", "megatron"] if mode == "xdist" else []
    cov = [f"--cov={source}", "--cov-report="] if measured else []
    return [sys.executable, *pytest_args, *extra, *cov]


def timed_run(argv: list[str], core: str | None) -> float:
    """Wall seconds of one run, in a fresh folder (its data files go there)."""
    env = dict(os.environ)
    if core:
        env["COVERAGE_CORE"] = core
    with tempfile.TemporaryDirectory(prefix="bench-coverage-") as cwd:
        start = time.perf_counter()
        run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-LOG_TAIL:])
        raise SystemExit(f"failed ({run.returncode}): {' '.join(argv)}\n{tail}")
    return seconds


def measure(modes: list[str], source: str, nproc: int, repeat: int, core: str | None) -> dict:
    results: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        samples: dict[str, list[float]] = {"plain": [], "coverage": []}
        for _ in range(repeat):
            for kind, measured in (("plain", False), ("coverage", True)):
                argv = command(mode, measured, source, nproc)
                samples[kind].append(timed_run(argv, core if measured else None))
                print(f"  {mode:8} {kind:8} {samples[kind][-1]:6.1f} s", flush=True)
        results[mode] = samples
    return results


def rows(results: dict) -> list[list[str]]:
    out = []
    for mode, samples in results.items():
        plain = statistics.median(samples["plain"])
        measured = statistics.median(samples["coverage"])
        out.append([mode, f"{plain:.1f}", f"{measured:.1f}", f"{measured / plain:.2f}x"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=default_source(), help="what --cov measures")
    parser.add_argument("--nproc", type=int, default=2, help="torchrun's ranks per node")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    sysmon = "sysmon" if sys.version_info >= (3, 12) else None
    parser.add_argument("--core", default=sysmon, help="COVERAGE_CORE of the measured runs")
    parser.add_argument("--json", help="write the samples here")
    args = parser.parse_args()
    print("\n".join(header_lines("coverage overhead on the example suite", INFO)))
    print(f"source  : {args.source}; COVERAGE_CORE={args.core or '(coverage default)'}")
    results = measure(args.modes.split(","), args.source, args.nproc, args.repeat, args.core)
    print(table(["mode", "plain s", "--cov s", "overhead"], rows(results)))
    if args.json:
        write_json(
            args.json, {"machine": INFO, "source": args.source, "core": args.core, **results}
        )


if __name__ == "__main__":
    main()
