"""DeepSpeed's own unit tests (its `DistributedTest` harness starts a process pool for every test
and world size) with and without the plugin: plain pytest serially and with `-n N`, the plugin
serially and with `-n N --dist megatron`, in one run on one machine. Walls, ratios to plain
pytest, and every test whose outcome differs from plain pytest's serial run.

The test files are DeepSpeed's, unchanged, from its repository at the installed release (`--tests
DIR` is its `tests` folder, whose conftest and pytest.ini the runs use; it is not part of this
repository). DeepSpeed's harness needs pytest < 8.4. `--devices cpu` hides the GPUs and selects
DeepSpeed's CPU accelerator (gloo), whose device count is `LOCAL_SIZE` (`--local-size`). The
plugin makes one test per size of a world-size list (ids ws1, ws2...): such a test's outcome is
its sizes' (failed if one failed, else skipped if one skipped). Progress goes to stderr, the
table to stdout.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from _util import (
    HARNESS_MODES,
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
SIZE_ID = re.compile(r"ws\d+-|-ws\d+|\[ws\d+\]")  # the plugin's id of one size of a list
DEFAULT_FILES = [
    "unit/comm/test_dist.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/utils/test_init_on_device.py",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="DeepSpeed's tests folder")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES)
    parser.add_argument("-n", dest="workers", default="auto", help="xdist workers (default auto)")
    parser.add_argument("--devices", choices=("cpu", "visible"), default="visible")
    parser.add_argument("--local-size", default="4", help="LOCAL_SIZE with --devices cpu")
    parser.add_argument("--timeout", default="300", help="DS_UNITTEST_TIMEOUT (default 300)")
    parser.add_argument("-k", dest="keyword", help="pytest's -k, in every run")
    modes = list(HARNESS_MODES)
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()

    folder = os.path.abspath(args.tests)
    environ = dict(os.environ, DS_UNITTEST_TIMEOUT=args.timeout)
    if args.devices == "cpu":
        environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", LOCAL_SIZE=args.local_size)
    selection = [*args.files, *(("-k", args.keyword) if args.keyword else ())]
    runs = {mode: _run(mode, folder, selection, args.workers, environ) for mode in args.modes}
    baseline_mode = args.modes[0]
    baseline = runs[baseline_mode][1]
    rows = []
    for mode, (wall, outcomes) in runs.items():
        counts = {word: list(outcomes.values()).count(word) for word in OUTCOMES}
        differ = sorted(
            test
            for test in baseline.keys() | outcomes.keys()
            if outcomes.get(test) != baseline.get(test)
        )
        rows.append(
            [
                mode,
                f"{wall:.1f}",
                ratio(runs[baseline_mode][0], wall),
                *(str(counts[word]) for word in OUTCOMES),
                str(len(differ)),
            ]
        )
        for test in differ[:10]:
            progress(f"{mode}: {test}: {outcomes.get(test)} (vs {baseline.get(test)})")
    title = f"DeepSpeed's DistributedTest harness: {len(baseline)} tests of {len(args.files)} files"
    print("\n".join(header_lines(title, INFO)))
    print(f"files: {' '.join(args.files)}" + (f" -k {args.keyword!r}" if args.keyword else ""))
    settings = f"-n {args.workers}; devices {args.devices}"
    if args.devices == "cpu":
        settings += f" (DS_ACCELERATOR=cpu, LOCAL_SIZE={args.local_size}, gloo)"
    print(f"settings: {settings}")
    print()
    headers = ["mode", "wall s", f"vs {baseline_mode}", "passed", "failed", "skipped", "differ"]
    print(table(headers, rows))
    write_record(args.json, INFO, tests=len(baseline), runs={m: r[0] for m, r in runs.items()})
    return 0


def _run(
    mode: str, folder: str, selection: list[str], workers: str, environ: dict[str, str]
) -> tuple[float, dict[str, str]]:
    """The mode's wall and outcomes; a test split by size takes its sizes' outcome (failed if
    one failed, else skipped if one skipped)."""
    arguments = [*(option.format(workers=workers) for option in HARNESS_MODES[mode]), *selection]
    wall, cases = run_for_outcomes(mode, arguments, folder, environ, RUN_TIMEOUT_S)
    seen: dict[str, set[str]] = {}
    for case in cases:
        name = SIZE_ID.sub("", case.get("name", "")).replace("[]", "")
        seen.setdefault(f"{case.get('classname')}::{name}", set()).add(outcome_of(case))
    order = ("failed", "skipped", "passed")
    outcomes = {test: next(o for o in order if o in found) for test, found in seen.items()}
    progress(f"{mode}: {wall:.1f} s, {counted(outcomes)}")
    return wall, outcomes


if __name__ == "__main__":
    sys.exit(main())
