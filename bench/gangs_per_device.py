"""What `--megatron-gangs-per-device K` gives a suite of small distributed tests: a generated suite
of world-size-2 tests (a barrier, then a sleep; on fewer devices, world size 1) run serially and
under `-n auto --dist megatron` with each K, the modes alternating, whole-process wall time of
each run, medians and their ratio to serial. The issue's case: `--devices cpu:2`.

`-n auto` starts devices x K workers (CPU cores x K in CPU mode, at most one per slot), and at most
K gangs hold a device at once. The bodies sleep, so sharing costs them nothing: this measures what
the plugin's scheduling and gang starts allow, not what a real test's kernels would share.
Run `python bench/gangs_per_device.py --help`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _util import (
    header_lines,
    left_out_line,
    machine,
    resolve_devices,
)
from xdist_overhead import add_suite_options, alternate, walls_table, write_suite

WORLD_SIZE = 2


def modes(per_device: list[int]) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {"serial": []}
    for k in per_device:
        runs[f"-n auto, K={k}"] = ["-n", "auto", "--dist", "megatron"]
        runs[f"-n auto, K={k}"] += ["--megatron-gangs-per-device", str(k)]
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_suite_options(parser, tests=32, modules=8)
    parser.add_argument("--per-device", default="1,4", help="the Ks to run (default 1,4)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = resolve_devices(args.devices)
    world_size = min(WORLD_SIZE, devices.count)
    left_out = [] if world_size == WORLD_SIZE else [devices.shortfall(WORLD_SIZE)]
    info = machine()
    runs = modes([int(k) for k in args.per_device.split(",")])
    with tempfile.TemporaryDirectory(prefix="gangs-per-device-") as folder:
        sleeps = write_suite(Path(folder), args, world_size)
        walls = alternate(Path(folder), runs, args.rounds, devices.plugin_options())
    print("\n".join(header_lines("xdist-megatron benchmark: gangs per device", info)))
    print(f"suite   : {args.tests} tests of world size {world_size} in {args.modules} modules,")
    print(f"          {sleeps:.1f} s of sleep in all ({args.min_s}-{args.max_s} s each)")
    print(f"devices : {devices.describe()}")
    print(left_out_line(left_out))
    print("\nWhole-process wall [s]; each round starts with the next mode; speed-up: serial / mode")
    print(walls_table(walls, "speed-up", lambda median, serial: serial / median))
    return 0


if __name__ == "__main__":
    sys.exit(main())
