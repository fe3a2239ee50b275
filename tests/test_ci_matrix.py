"""End to end: the options a CI matrix uses: --megatron-shard, --megatron-world-sizes and the
durations file (--megatron-durations, --megatron-store-durations), serially and under xdist."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from test_sharding import generated_suite

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CPU8 = ("--megatron-devices", "cpu:8")

SIZES_MODULE = """
import pytest

def test_unmarked():
    pass

@pytest.mark.world_size(1, 2, 4)
def test_sizes(world_size):
    pass

@pytest.mark.world_size(2)
def test_pair(rank, world_size):
    assert world_size == 2
"""


def collected(result: pytest.RunResult) -> list[str]:
    """The node ids `--collect-only -q` printed."""
    return [line for line in result.outlines if "::" in line and " " not in line]


def write_generated_suite(pytester: pytest.Pytester) -> dict[str, float]:
    """The 200-test suite of test_sharding as files, its durations in durations.json; returns
    each test's device-seconds."""
    modules: dict[str, list[str]] = defaultdict(lambda: ["import pytest"])
    timings = {}
    for entry in generated_suite():
        name = entry.nodeid.split("::")[1]
        marker = f"@pytest.mark.world_size({entry.world_size})\n" if entry.world_size else ""
        modules[entry.module].append(f"{marker}def {name}():\n    pass\n")
        timings[entry.nodeid] = {"world_size": entry.world_size, "duration": entry.duration}
    for module, parts in modules.items():
        path = pytester.path / module
        path.parent.mkdir(exist_ok=True)
        path.write_text("\n\n".join(parts))
    (pytester.path / "durations.json").write_text(json.dumps({"version": 1, "tests": timings}))
    return {e.nodeid: e.device_time for e in generated_suite()}


def test_shards_of_the_generated_suite_are_disjoint_complete_and_balanced(run_pytest, pytester):
    device_time = write_generated_suite(pytester)
    parts = []
    for k in range(1, 5):
        result = run_pytest(
            "--collect-only", "-q", *CPU8, "--megatron-durations", "durations.json",
            f"--megatron-shard={k}/4",
        )  # fmt: skip
        parts.append(collected(result))
        result.stdout.fnmatch_lines([f"{len(parts[-1])}/200 tests collected*deselected*"])
    flat = [nodeid for part in parts for nodeid in part]
    assert sorted(flat) == sorted(device_time) and len(set(flat)) == 200
    loads = [sum(device_time[n] for n in part) for part in parts]
    assert max(loads) / min(loads) <= 1.15, loads


def test_shards_of_the_example_suite_are_disjoint_and_complete(run_pytest):
    whole = collected(run_pytest("--collect-only", "-q", str(EXAMPLES)))
    parts = [  # two shards: a larger count is the generated suite's test
        collected(run_pytest("--collect-only", "-q", str(EXAMPLES), f"--megatron-shard={k}/2"))
        for k in range(1, 3)
    ]
    flat = [nodeid for part in parts for nodeid in part]
    assert sorted(flat) == sorted(whole) and len(set(flat)) == len(whole) > 20
    for part in parts:  # a (module, world size) unit is never split (where the id says the size)
        units = {_unit(n) for n in part if _unit(n)[1]}
        assert all(n in part for n in whole if _unit(n) in units)


def _unit(nodeid: str) -> tuple[str, str | None]:
    found = re.search(r"ws\d+", nodeid)
    return nodeid.split("::")[0], found.group() if found else None


def test_world_sizes_deselect_the_other_sizes(run_pytest, pytester):
    pytester.makepyfile(test_sizes=SIZES_MODULE)
    result = run_pytest("--collect-only", "-q", *CPU8, "--megatron-world-sizes", "2,4")
    assert collected(result) == [
        "test_sizes.py::test_sizes[ws2]",
        "test_sizes.py::test_sizes[ws4]",
        "test_sizes.py::test_pair",
    ]
    result.stdout.fnmatch_lines(["3/5 tests collected (2 deselected)*"])


def test_unmarked_tests_count_as_world_size_one_unless_given_a_size(run_pytest, pytester):
    pytester.makepyfile(test_sizes=SIZES_MODULE)
    pytester.makeini("[pytest]\nmegatron_world_sizes = 1\n")
    result = run_pytest("--collect-only", "-q", *CPU8)
    assert collected(result) == ["test_sizes.py::test_unmarked", "test_sizes.py::test_sizes[ws1]"]
    given = run_pytest("--collect-only", "-q", *CPU8, "--megatron-world-size=2")
    assert collected(given) == ["test_sizes.py::test_sizes[ws1]"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--megatron-world-sizes", "2,x"), "--megatron-world-sizes*positive ints*'2,x'"),
        (("--megatron-world-sizes", "0"), "--megatron-world-sizes*positive ints*'0'"),
        (("--megatron-shard", "5/4"), "--megatron-shard: expected K/N*'5/4'"),
        (("--megatron-store-durations",), "--megatron-store-durations needs --megatron-dur*"),
        (("--megatron-durations", "bad.json"), "--megatron-durations*bad.json: expected*"),
        (("--megatron-durations", "list.json"), "--megatron-durations*list.json: expected*"),
    ],
)
def test_malformed_options_are_usage_errors_naming_the_option(run_pytest, pytester, args, message):
    pytester.makepyfile(test_sizes=SIZES_MODULE)
    (pytester.path / "bad.json").write_text('{"tests": []}')
    (pytester.path / "list.json").write_text("[1, 2]")  # JSON, but not an object
    result = run_pytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


def test_the_durations_file_is_written_and_merged(run_pytest, pytester):
    pytester.makepyfile(test_sizes=SIZES_MODULE)
    store = ("--megatron-durations", "ci/durations.json", "--megatron-store-durations", *CPU8)
    run_pytest(*store, "--megatron-world-sizes=2").assert_outcomes(passed=2, deselected=3)
    tests = json.loads((pytester.path / "ci/durations.json").read_text())["tests"]
    assert {n: t["world_size"] for n, t in tests.items()} == {
        "test_sizes.py::test_sizes[ws2]": 2,
        "test_sizes.py::test_pair": 2,
    }
    assert all(t["duration"] > 0 for t in tests.values())
    run_pytest(*store, "-k", "unmarked").assert_outcomes(passed=1, deselected=4)
    merged = json.loads((pytester.path / "ci/durations.json").read_text())
    assert merged["version"] == 1
    assert merged["tests"]["test_sizes.py::test_unmarked"]["world_size"] is None
    assert set(merged["tests"]) == {*tests, "test_sizes.py::test_unmarked"}


def test_a_separate_path_that_would_hide_the_suites_ini_is_a_usage_error(run_pytest, pytester):
    """pytest chooses its rootdir before the plugin's options exist, so the value of
    `--megatron-durations PATH` counts as a test path there. With a setup.py above the suite, as
    at Megatron-LM's root, a file beside it moved the rootdir there, and the suite's pytest.ini
    was not read (a whole Megatron-LM run lost its --deselect that way). Where pytest's choice
    stays the same, the separate form is fine."""
    suite = pytester.mkdir("suite")
    (suite / "pytest.ini").write_text("[pytest]\naddopts = -k 'not two'\n")
    (suite / "test_one.py").write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    (pytester.path / "d.json").write_text('{"version": 1, "tests": {}}')
    (suite / "inside.json").write_text('{"version": 1, "tests": {}}')
    (pytester.path / "setup.py").write_text("")
    hidden = run_pytest("suite", "--megatron-durations", "d.json")
    assert hidden.ret == pytest.ExitCode.USAGE_ERROR
    hidden.stderr.fnmatch_lines(["*pytest took d.json for a test path*no ini file; without it*"])
    hidden.stderr.fnmatch_lines(["*suite?pytest.ini); write --megatron-durations=d.json*"])
    run_pytest("suite", "--megatron-durations=d.json").assert_outcomes(passed=1, deselected=1)
    inside = run_pytest("suite", "--megatron-durations", "suite/inside.json")
    inside.assert_outcomes(passed=1, deselected=1)
    chosen = run_pytest("-c", "suite/pytest.ini", "suite", "--megatron-durations", "d.json")
    chosen.assert_outcomes(passed=1, deselected=1)  # -c names the ini: nothing moves it
    (pytester.path / "setup.py").unlink()  # pytest then finds the suite's ini all the same
    run_pytest("suite", "--megatron-durations", "d.json").assert_outcomes(passed=1, deselected=1)


def test_the_durations_file_decides_the_shards(run_pytest, pytester):
    pytester.makepyfile(test_a="def test_a():\n    pass\n", test_b="def test_b():\n    pass\n")
    ids = ["test_a.py::test_a", "test_b.py::test_b"]
    for slow, fast in (ids, ids[::-1]):
        timings = {slow: {"duration": 9.0}, fast: {"duration": 1.0}}
        (pytester.path / "d.json").write_text(json.dumps({"version": 1, "tests": timings}))
        result = run_pytest(
            "--collect-only", "-q", "--megatron-durations=d.json", "--megatron-shard=1/2"
        )
        assert collected(result) == [slow]  # the longest unit goes to the first part


def test_shards_under_xdist_run_disjoint_parts_of_the_suite(run_pytest, pytester):
    pytester.makepyfile(test_sizes=SIZES_MODULE, test_other=SIZES_MODULE)
    outcomes = []
    for k in (1, 2):
        result = run_pytest("-n", "2", "--dist", "megatron", *CPU8, f"--megatron-shard={k}/2", "-v")
        assert "collected differently" not in result.stdout.str() + result.stderr.str()
        outcomes.append(sorted(re.findall(r"PASSED (test_\w+\.py::\S+)", result.stdout.str())))
        assert result.ret == 0
    assert outcomes[0] and outcomes[1] and not set(outcomes[0]) & set(outcomes[1])
    assert len(outcomes[0]) + len(outcomes[1]) == 10


def test_the_jobs_durations_files_merge_into_one() -> None:
    spec = importlib.util.spec_from_file_location("merge", EXAMPLES / "ci" / "merge_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = {"version": 1, "tests": {"a": {"duration": 1.0}, "b": {"duration": 2.0}}}
    job_a = {"version": 1, "tests": {"a": {"duration": 1.5}, "b": {"duration": 2.0}}}
    job_b = {"version": 1, "tests": {"a": {"duration": 1.0}, "b": {"duration": 2.5}, "c": {}}}
    merged = module.merge(committed, [job_a, job_b])
    assert merged["tests"] == {"a": {"duration": 1.5}, "b": {"duration": 2.5}, "c": {}}
