"""How long a short session takes to run its first test on a gang, with the zygote started after
collection (nothing known in advance) against before it (the preloads remembered in the pytest
cache from the last session that ran gangs).

The suite is a few modules that import a heavy package (megatron.core where installed) and hold
one world_size(2) test each. Both variants run on the same suite, alternately, `--repeats` times;
"after collection" runs with the cache disabled, "before collection" after one priming run that
filled the cache. Each row gives the wall time of the whole pytest process, plain and under
`-n 2 --dist megatron` (where the xdist controller's shared zygote starts before the workers
collect), and how long the process ran after the last test body ended (gangs, zygote and
interpreter shutting down). Progress goes to stderr, the table to stdout.
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

SUITE_MODULE = """import os
import time

import pytest
import torch.distributed as dist
import {heavy}


@pytest.mark.world_size(2)
def test_all_reduce(rank):
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    with open(os.path.join({folder!r}, "ended"), "a") as f:
        f.write(f"{{time.time()}}\\n")
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
            f.write(SUITE_MODULE.format(heavy=heavy, folder=folder))


def run_session(folder: str, options: list[str]) -> tuple[float, float]:
    """Wall time of one pytest process on the suite, and how long it ran after the last test
    body ended (shutting gangs, zygote and interpreter down); fails loudly if a test failed."""
    command = [sys.executable, "-m", "pytest", "-q", *options]
    ended = os.path.join(folder, "ended")
    if os.path.exists(ended):
        os.remove(ended)
    start = time.time()
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    finished = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    with open(ended) as f:
        last_body_end = max(float(line) for line in f)
    return finished - start, finished - last_body_end


Samples = dict[str, dict[str, list[float]]]  # run -> variant (or "exit") -> seconds


def measure(folder: str, repeats: int) -> Samples:
    samples: Samples = {m: {v: [] for v in [*VARIANTS, "exit"]} for m in MODES}
    for mode, mode_options in MODES.items():
        run_session(folder, mode_options)  # primes the cache for "before collection"
        for attempt in range(repeats):
            for variant, variant_options in VARIANTS.items():
                wall, exit_time = run_session(folder, [*mode_options, *variant_options])
                samples[mode][variant].append(wall)
                samples[mode]["exit"].append(exit_time)
                progress(f"{mode}, {variant}, run {attempt + 1}: {wall:.1f} s")
    return samples


def report(samples: Samples, heavy: str, repeats: int) -> str:
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
