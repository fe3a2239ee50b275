"""How long a short session takes to run its first test on a gang, with the zygote started after
collection (nothing known in advance) against before it (the preloads remembered in the pytest
cache from the last session that ran gangs).

The suite is a few modules that import a heavy package (megatron.core where installed) and hold
one world_size(2) test each. Both variants run on the same suite, alternately, `--repeats` times;
"after collection" runs with the cache disabled, "before collection" after one priming run that
filled the cache. Each row gives the wall time of the whole pytest process, plain and under
`-n 2 --dist megatron` (where the xdist controller's shared zygote starts before the workers
collect), and how long the process ran after the last test body ended (gangs, zygote and
interpreter shutting down). On one device (`--devices`) the tests are world_size(1), and the
report says so. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _util import (
    BenchmarkError,
    Devices,
    add_devices_option,
    header_lines,
    importable,
    left_out_line,
    machine,
    progress,
    resolve_devices,
    run_checked,
    summarize,
    table,
    tail,
    write_ini,
    write_record,
)

INFO = machine()
RUN_TIMEOUT_S = 600.0
MODULES = 3
SIZE = 2  # the world size of the suite's tests, where it fits

SUITE_MODULE = """import os
import time

import pytest
import torch.distributed as dist
import {heavy}


@pytest.mark.world_size({size})
def test_all_reduce(rank):
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {size}
    with open(os.path.join({folder!r}, "ended"), "a") as f:
        f.write(f"{{time.time()}}\\n")
"""

MODES = {"plain": [], "-n 2 --dist megatron": ["-n", "2", "--dist", "megatron"]}
MODE_NAMES = {"plain": "plain", "xdist": "-n 2 --dist megatron"}  # --modes takes the keys
VARIANTS = {"after collection": ["-p", "no:cacheprovider"], "before collection": []}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--heavy-import", help="module each test module imports")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.add_argument(
        "--modes", default=",".join(MODE_NAMES), help="of plain, xdist (default both)"
    )
    add_devices_option(parser)
    args = parser.parse_args(argv)
    if args.heavy_import is None:
        args.heavy_import = "megatron.core" if importable("megatron.core") else "torch.distributed"
    args.modes = [mode for mode in args.modes.split(",") if mode]
    unknown = set(args.modes) - set(MODE_NAMES)
    if unknown or not args.modes:
        parser.error(f"--modes: of {', '.join(MODE_NAMES)}, got {', '.join(sorted(unknown))}")
    return args


def suite_size(devices: Devices) -> tuple[int, list[str]]:
    """SIZE where it fits, else 1; and what was left out."""
    if devices.count >= SIZE:
        return SIZE, []
    return 1, [f"world_size({SIZE}) tests: {devices.shortfall(SIZE)}; the tests are world_size(1)"]


def write_suite(folder: str, heavy: str, size: int) -> None:
    write_ini(folder)
    for index in range(MODULES):
        with open(os.path.join(folder, f"test_module_{index}.py"), "w") as f:
            f.write(SUITE_MODULE.format(heavy=heavy, folder=folder, size=size))


def run_session(folder: str, options: list[str]) -> tuple[float, float]:
    """Wall time of one pytest process on the suite, and how long it ran after the last test
    body ended (shutting gangs, zygote and interpreter down); fails loudly if a test failed."""
    command = [sys.executable, "-m", "pytest", "-q", *options]
    ended = os.path.join(folder, "ended")
    if os.path.exists(ended):
        os.remove(ended)
    wall, output = run_checked(command, folder, RUN_TIMEOUT_S)
    finished = time.time()
    if not os.path.exists(ended):
        raise BenchmarkError(f"no test body ran: {' '.join(command)}\n{tail(output, 40)}")
    with open(ended) as f:
        last_body_end = max(float(line) for line in f)
    return wall, finished - last_body_end


Samples = dict[str, dict[str, list[float]]]  # run -> variant (or "exit") -> seconds


def measure(folder: str, repeats: int, modes: list[str], devices: Devices) -> Samples:
    samples: Samples = {m: {v: [] for v in [*VARIANTS, "exit"]} for m in modes}
    for mode in modes:
        mode_options = [*MODES[mode], *devices.plugin_options()]
        run_session(folder, mode_options)  # primes the cache for "before collection"
        for attempt in range(repeats):
            for variant, variant_options in VARIANTS.items():
                wall, exit_time = run_session(folder, [*mode_options, *variant_options])
                samples[mode][variant].append(wall)
                samples[mode]["exit"].append(exit_time)
                progress(f"{mode}, {variant}, run {attempt + 1}: {wall:.1f} s")
    return samples


def report(
    samples: Samples, heavy: str, repeats: int, devices: Devices, size: int, left_out: list[str]
) -> str:
    rows = []
    for mode, by_variant in samples.items():
        after = summarize(by_variant["after collection"])["median"]
        before = summarize(by_variant["before collection"])["median"]
        exit_time = summarize(by_variant["exit"])["median"]
        rows.append(
            [
                mode,
                f"{after:.1f}",
                f"{before:.1f}",
                f"{after - before:.1f}",
                f"{after / before:.2f}x",
                f"{exit_time:.1f}",
            ]
        )
    headers = [
        "run",
        "after coll. p50 s",
        "before coll. p50 s",
        "saved s",
        "ratio",
        "last test to exit p50 s",
    ]
    lines = header_lines("Zygote start before collection", INFO)
    lines += [
        f"devices : {devices.describe()}",
        left_out_line(left_out),
        f"suite: {MODULES} modules importing {heavy}, one world_size({size}) test each; "
        f"{repeats} runs per variant, alternating; wall time of the pytest process",
        "",
        table(headers, rows),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = resolve_devices(args.devices)
    size, left_out = suite_size(devices)
    modes = [MODE_NAMES[mode] for mode in args.modes]
    with tempfile.TemporaryDirectory(prefix="session-start-") as folder:
        write_suite(folder, args.heavy_import, size)
        samples = measure(folder, args.repeats, modes, devices)
    print(report(samples, args.heavy_import, args.repeats, devices, size, left_out))
    write_record(
        args.json, INFO, heavy_import=args.heavy_import, devices=devices.spec, size=size,
        left_out=left_out, samples=samples,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
