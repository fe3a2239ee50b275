"""How long a short session takes to run its first test on a gang, with the zygote started after
collection (nothing known in advance) against before it (the preloads remembered in the pytest
cache from the last session that ran gangs).

The suite is a few modules that import a heavy package (megatron.core where installed) and hold
one world_size(2) test each. Both variants run on the same suite, alternately, `--repeats` times;
"after collection" runs with the cache disabled, "before collection" after one priming run that
filled the cache. Each row gives the wall time of the whole pytest process, plain and under
`-n 2 --dist megatron` (where the xdist controller's shared zygote starts before the workers
collect). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from _util import command_line, header_lines, machine, summarize, table, write_json

INFO = machine()
RUN_TIMEOUT_S = 600.0
MODULES = 3

SUITE_MODULE = """import pytest
import torch.distributed as dist
import {heavy}


@pytest.mark.world_size(2)
def test_all_reduce(rank):
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

MODES = {"plain": [], "-n 2 --dist megatron": ["-n", "2", "--dist", "megatron"]}
VARIANTS = {"after collection": ["-p", "no:cacheprovider"], "before collection": []}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--heavy-import", help="module each test module imports")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    args = parser.parse_args(argv)
    if args.heavy_import is None:
        found = importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core")
        args.heavy_import = "megatron.core" if found else "torch.distributed"
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_suite(folder: str, heavy: str) -> None:
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")  # the folder is the rootdir: no outer configuration applies
    for index in range(MODULES):
        with open(os.path.join(folder, f"test_module_{index}.py"), "w") as f:
            f.write(SUITE_MODULE.format(heavy=heavy))


def run_session(folder: str, options: list[str]) -> float:
    """Wall time of one pytest process on the suite; fails loudly if a test did not pass."""
    command = [sys.executable, "-m", "pytest", "-q", *options]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def measure(folder: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in MODES}
    for mode, mode_options in MODES.items():
        run_session(folder, mode_options)  # primes the cache for "before collection"
        for attempt in range(repeats):
            for variant, variant_options in VARIANTS.items():
                seconds = run_session(folder, [*mode_options, *variant_options])
                samples[mode][variant].append(seconds)
                progress(f"{mode}, {variant}, run {attempt + 1}: {seconds:.1f} s")
    return samples


def report(samples: dict[str, dict[str, list[float]]], heavy: str, repeats: int) -> str:
    rows = []
    for mode, by_variant in samples.items():
        after = summarize(by_variant["after collection"])
        before = summarize(by_variant["before collection"])
        rows.append(
            [
                mode,
                f"{after['median']:.1f}",
                f"{before['median']:.1f}",
                f"{after['median'] - before['median']:.1f}",
                f"{after['median'] / before['median']:.2f}x",
            ]
        )
    headers = ["run", "after coll. p50 s", "before coll. p50 s", "saved s", "ratio"]
    lines = header_lines("Zygote start before collection", INFO)
    lines += [
        f"suite: {MODULES} modules importing {heavy}, one world_size(2) test each; "
        f"{repeats} runs per variant, alternating; wall time of the pytest process",
        "",
        table(headers, rows),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="session-start-") as folder:
        write_suite(folder, args.heavy_import)
        samples = measure(folder, args.repeats)
    print(report(samples, args.heavy_import, args.repeats))
    if args.json:
        data: dict[str, Any] = {
            "command": command_line(),
            "machine": INFO,
            "heavy_import": args.heavy_import,
            "samples": samples,
        }
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
