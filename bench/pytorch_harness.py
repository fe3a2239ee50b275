"""PyTorch's own distributed tests (its `MultiProcessTestCase` harness spawns every test's ranks)
with and without the plugin: plain pytest serially and with `-n N`, the plugin serially and with
`-n N --dist megatron`, in one run on one machine. Walls, ratios to plain pytest, and every test
whose outcome differs from plain pytest's serial run.

The test files are PyTorch's, unchanged, from its repository at the release of the installed
torch (`--tests DIR` holds them; they are not part of this repository): for example
`test/distributed/test_distributed_spawn.py`, which runs the `distributed_test` classes shipped
in the wheel with `BACKEND=gloo WORLD_SIZE=2` and a `TEMP_DIR` with a `barrier` folder, set up
here as PyTorch's `run_test.py` sets them up (file init). `--every K` runs every K-th test of
each file (the same ones in each mode), where plain pytest's spawns would take too long;
`FILE:K` among `--files` sets K for that file alone.
`--devices cpu` hides the GPUs from every run. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

from _util import (
    HARNESS_MODES,
    NO_PLUGIN,
    OUTCOMES,
    counted,
    header_lines,
    machine,
    outcome_of,
    progress,
    ratio,
    run_for_outcomes,
    table,
    write_record,
)

INFO = machine()
RUN_TIMEOUT_S = 3600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="folder of PyTorch's test files")
    parser.add_argument(
        "--files", nargs="+", default=["test_distributed_spawn.py"], help="FILE or FILE:K"
    )
    parser.add_argument("-n", dest="workers", default="auto", help="xdist workers (default auto)")
    parser.add_argument(
        "--every", type=int, default=1, help="run every K-th test of each file (default 1)"
    )
    parser.add_argument("--devices", choices=("cpu", "visible"), default="visible")
    parser.add_argument("--backend", default="gloo", help="BACKEND of the files (default gloo)")
    parser.add_argument("--world-size", default="2", help="WORLD_SIZE of the files (default 2)")
    modes = list(HARNESS_MODES)
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    args.tests = os.path.abspath(args.tests)
    environ = _environment(args.devices, args.backend, args.world_size)
    every = {name: int(k or args.every) for name, _, k in (f.partition(":") for f in args.files)}
    ids = _selected(args.tests, every, environ)
    progress(f"{len(ids)} tests of {', '.join(every)}")
    runs = {mode: _run(mode, args.tests, ids, args.workers, environ) for mode in args.modes}
    baseline_mode = args.modes[0]
    baseline = runs[baseline_mode]
    rows = []
    for mode, (wall, outcomes) in runs.items():
        counts = {word: list(outcomes.values()).count(word) for word in OUTCOMES}
        differ = sorted(test for test in ids if outcomes.get(test) != baseline[1].get(test))
        rows.append(
            [
                mode,
                f"{wall:.1f}",
                ratio(baseline[0], wall),
                *(str(counts[word]) for word in OUTCOMES),
                str(len(differ)),
            ]
        )
        for test in differ[:10]:
            progress(f"{mode}: {test}: {outcomes.get(test)} (vs {baseline[1].get(test)})")
    title = f"PyTorch's spawn harness: {len(ids)} tests of {', '.join(every)}"
    print("\n".join(header_lines(title, INFO)))
    print(
        f"settings: BACKEND={args.backend} WORLD_SIZE={args.world_size}; -n {args.workers}; "
        f"devices {args.devices}; every K-th test of each file: {every}"
    )
    print()
    headers = ["mode", "wall s", f"vs {baseline_mode}", "passed", "failed", "skipped", "differ"]
    print(table(headers, rows))
    write_record(args.json, INFO, tests=len(ids), runs={m: r[0] for m, r in runs.items()})
    return 0


def _environment(devices: str, backend: str, world_size: str) -> dict[str, str]:
    """What PyTorch's run_test.py sets for these files: the backend, the world size, its temp
    folders and a file init method."""
    temp = tempfile.mkdtemp(prefix="pytorch-harness-")
    for folder in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(temp, folder))
    environ = dict(os.environ, BACKEND=backend, WORLD_SIZE=world_size, TEMP_DIR=temp)
    environ["INIT_METHOD"] = "file://" + os.path.join(temp, "init_dir", "shared_init_file")
    if devices == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""
    return environ


def _selected(folder: str, every: dict[str, int], environ: dict[str, str]) -> list[str]:
    """Every K-th collected test of each file, in collection order."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", *NO_PLUGIN]
    command += [f"--rootdir={folder}", *every]
    done = subprocess.run(
        command, cwd=folder, env=environ, capture_output=True, text=True, check=True
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    selected = []
    for name, k in every.items():
        selected += [test for test in ids if test.startswith(name + "::")][::k]
    return selected


def _run(
    mode: str, folder: str, ids: list[str], workers: str, environ: dict[str, str]
) -> tuple[float, dict[str, str]]:
    options = [option.format(workers=workers) for option in HARNESS_MODES[mode]]
    arguments = [*options, f"--rootdir={folder}", *ids]
    wall, cases = run_for_outcomes(mode, arguments, folder, environ, RUN_TIMEOUT_S)
    outcomes = {_nodeid(case): outcome_of(case) for case in cases}
    progress(f"{mode}: {wall:.1f} s, {counted(outcomes)}")  # a run cut short still leaves these
    return wall, outcomes


def _nodeid(case: ElementTree.Element) -> str:
    """The node id of a junit test case of these files (classes in modules)."""
    path = case.get("classname", "").replace(".", "/")
    module, _, cls = path.rpartition("/")
    return f"{module}.py::{cls}::{case.get('name')}"


if __name__ == "__main__":
    sys.exit(main())
