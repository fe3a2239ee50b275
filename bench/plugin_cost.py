"""What having the plugin installed costs a run that uses none of it, and when a run that does
use it gets its zygote.

Plain suites: `python -m pytest` with the plugin installed (loaded through its entry point, as
pip installs it) and with `-p no:xdist_megatron.plugin`, alternating, `--repeats` times each; the
median wall time of each and the difference (the target: within 50 ms). One suite's conftest
imports torch, as a torch project's does (the plugin used to start its zygote there); the other
imports nothing, which leaves the plugin's own import and hooks. Beside them, the median time
`import xdist_megatron.plugin` takes once pytest is imported.

A suite with gangs: modules that import torch.distributed and hold one world_size(2) test each
(world_size(1) on one device), its conftest importing torch, run with no option of the plugin's.
Launch to the first test body, in its first run (nothing in the pytest cache: the zygote starts
when collection finds the first marked test) and in the run after it (the cache's record of the
first: the zygote starts while the conftest imports torch); with `--baseline DIR` (a checkout of
another revision, put first on PYTHONPATH) the same for that package, alternating. Progress goes
to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from _util import (
    BenchmarkError,
    Devices,
    add_devices_option,
    header_lines,
    left_out_line,
    machine,
    progress,
    resolve_devices,
    run_checked,
    summarize,
    table,
    write_ini,
    write_record,
)

INFO = machine()
RUN_TIMEOUT_S = 600.0
NO_PLUGIN = ["-p", "no:xdist_megatron.plugin"]
PLAIN_TESTS = "".join(f"\n\ndef test_{i}():\n    assert {i} + 1 > {i}\n" for i in range(20))
PLAIN_SUITES = {"conftest imports torch": "import torch  # noqa: F401\n", "no imports": ""}
MODULES = 3
SIZE = 2  # the world size of the marked suite's tests, where it fits
MARKED_MODULE = """import os
import time

import pytest
import torch.distributed as dist


@pytest.mark.world_size({size})
def test_all_reduce():
    with open(os.path.join({folder!r}, "started"), "a") as f:
        f.write(f"{{time.time()}}\\n")
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {size}
"""
IMPORT_CODE = (
    "import time, pytest; start = time.perf_counter(); import xdist_megatron.plugin; "
    "print(time.perf_counter() - start)"
)

Samples = dict[str, dict[str, list[float]]]  # row -> column -> seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs of each plain variant")
    parser.add_argument(
        "--cycles", type=int, default=3, help="first and second runs of the suite with gangs"
    )
    parser.add_argument("--baseline", metavar="DIR", help="a checkout to compare gangs with")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    add_devices_option(parser)
    args = parser.parse_args(argv)
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "xdist_megatron")):
        parser.error(f"--baseline {args.baseline}: no xdist_megatron package there")
    return args


def timed(command: list[str], folder: str, env: dict[str, str]) -> float:
    seconds, _ = run_checked(command, folder, RUN_TIMEOUT_S, env)
    return seconds


def measure_plain(root: str, repeats: int, env: dict[str, str]) -> Samples:
    """Each plain suite with the plugin and without it, alternating."""
    samples: Samples = {}
    for name, conftest in PLAIN_SUITES.items():
        folder = os.path.join(root, f"plain-{len(samples)}")
        os.mkdir(folder)
        write_ini(folder)
        with open(os.path.join(folder, "conftest.py"), "w") as f:
            f.write(conftest)
        with open(os.path.join(folder, "test_plain.py"), "w") as f:
            f.write(PLAIN_TESTS)
        samples[name] = {"installed": [], "disabled": []}
        command = [sys.executable, "-m", "pytest", "-q"]
        for attempt in range(repeats):
            samples[name]["installed"].append(timed(command, folder, env))
            samples[name]["disabled"].append(timed([*command, *NO_PLUGIN], folder, env))
            progress(f"{name}, run {attempt + 1}: {samples[name]['installed'][-1]:.2f} s")
    return samples


def measure_import(repeats: int, env: dict[str, str]) -> list[float]:
    """Seconds `import xdist_megatron.plugin` takes in a fresh process that imported pytest."""
    found = []
    for _ in range(repeats):
        _, output = run_checked([sys.executable, "-c", IMPORT_CODE], os.getcwd(), 60, env)
        found.append(float(output.strip()))
    return found


def write_marked_suite(folder: str, size: int) -> None:
    os.mkdir(folder)
    write_ini(folder)
    with open(os.path.join(folder, "conftest.py"), "w") as f:
        f.write("import torch  # noqa: F401\n")
    for index in range(MODULES):
        with open(os.path.join(folder, f"test_module_{index}.py"), "w") as f:
            f.write(MARKED_MODULE.format(size=size, folder=folder))


def to_first_test(folder: str, env: dict[str, str]) -> float:
    """Seconds from launching pytest on the suite to its first test body's start."""
    started = os.path.join(folder, "started")
    if os.path.exists(started):
        os.remove(started)
    launch = time.time()
    run_checked([sys.executable, "-m", "pytest", "-q"], folder, RUN_TIMEOUT_S, env)
    if not os.path.exists(started):
        raise BenchmarkError(f"no test body ran in {folder}")
    with open(started) as f:
        return min(float(line) for line in f) - launch


def measure_gangs(root: str, cycles: int, size: int, packages: dict[str, dict]) -> Samples:
    """For each package, alternating: a first run on a fresh suite, then the run after it."""
    samples: Samples = {name: {"first run": [], "second run": []} for name in packages}
    for cycle in range(cycles):
        for name, env in packages.items():
            folder = os.path.join(root, f"gangs-{cycle}-{len(samples[name]['first run'])}-{name}")
            write_marked_suite(folder, size)
            samples[name]["first run"].append(to_first_test(folder, env))
            samples[name]["second run"].append(to_first_test(folder, env))
            shutil.rmtree(folder)
            first, second = samples[name]["first run"][-1], samples[name]["second run"][-1]
            progress(f"gangs, {name}, cycle {cycle + 1}: first {first:.2f} s, then {second:.2f} s")
    return samples


def environments(baseline: str | None, devices: Devices) -> dict[str, dict]:
    """This checkout's package, and the baseline's first on PYTHONPATH; the devices' GPUs
    visible (no option of the plugin's: the runs must decide by themselves to use it)."""
    env = {**os.environ, **devices.visible_env()}
    found = {"this package": env}
    if baseline:
        path = os.pathsep.join(p for p in (os.path.abspath(baseline), env.get("PYTHONPATH")) if p)
        found["baseline"] = {**env, "PYTHONPATH": path}
    return found


def median_ms(samples: list[float]) -> float:
    return summarize(samples)["median"] * 1000


def plain_table(samples: Samples, imports: list[float]) -> list[str]:
    rows = []
    for name, runs in samples.items():
        installed, disabled = median_ms(runs["installed"]), median_ms(runs["disabled"])
        rows.append([name, f"{installed:.0f}", f"{disabled:.0f}", f"{installed - disabled:+.0f}"])
    headers = ["plain suite", "installed p50 ms", "-p no:... p50 ms", "difference ms"]
    return [
        table(headers, rows),
        "",
        f"import xdist_megatron.plugin after pytest: {median_ms(imports):.1f} ms (p50)",
    ]


def gangs_table(samples: Samples) -> str:
    rows = [
        [name, f"{median_ms(runs['first run']):.0f}", f"{median_ms(runs['second run']):.0f}"]
        for name, runs in samples.items()
    ]
    return table(["package", "first run p50 ms", "second run p50 ms"], rows)


def report(args: argparse.Namespace, plain: Samples, imports: list[float], gangs: Samples,
           devices: Devices, size: int, left_out: list[str]) -> str:  # fmt: skip
    lines = header_lines("The plugin installed in runs that do not use it", INFO)
    lines += [
        f"devices : {devices.describe()}",
        left_out_line(left_out),
        f"plain suites: 20 tests each; {args.repeats} runs per variant, alternating; wall time",
        "",
        *plain_table(plain, imports),
        "",
        f"suite with gangs: {MODULES} modules, one world_size({size}) test each, conftest "
        f"imports torch, no option; {args.cycles} cycles of a first and a second run per "
        "package, alternating; launch to the first test body",
        "",
        gangs_table(gangs),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = resolve_devices(args.devices)
    size = SIZE if devices.count >= SIZE else 1
    left_out = [] if size == SIZE else [f"world_size({SIZE}): {devices.shortfall(SIZE)}"]
    packages = environments(args.baseline, devices)
    with tempfile.TemporaryDirectory(prefix="plugin-cost-") as root:
        plain = measure_plain(root, args.repeats, packages["this package"])
        imports = measure_import(args.repeats, packages["this package"])
        gangs = measure_gangs(root, args.cycles, size, packages)
    print(report(args, plain, imports, gangs, devices, size, left_out))
    write_record(
        args.json, INFO, baseline=args.baseline, devices=devices.spec, size=size,
        left_out=left_out, plain=plain, imports=imports, gangs=gangs,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
