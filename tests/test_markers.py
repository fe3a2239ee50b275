"""End to end: the world_size marker, the device count, the options, and what a rank sees."""

from __future__ import annotations

import os

import pytest

from xdist_megatron.placement import cpu_slots

DEFAULT_SLOTS = cpu_slots(os.cpu_count() or 1)

# Each rank-0 body appends "<name> <world size>" to sizes.log, so a test can tell which gang ran it.
RECORD = """
import os

def record(name, world_size):
    if os.environ["RANK"] == "0":
        with open(os.path.join(os.path.dirname(__file__), "sizes.log"), "a") as f:
            f.write(f"{name} {world_size}\\n")
"""


def recorded(pytester: pytest.Pytester) -> dict[str, list[int]]:
    """What the suite's rank-0 bodies wrote to sizes.log: name -> world sizes, in run order."""
    sizes: dict[str, list[int]] = {}
    for line in (pytester.path / "sizes.log").read_text().splitlines():
        name, size = line.split()
        sizes.setdefault(name, []).append(int(size))
    return sizes


def test_closest_marker_wins_and_sizes_make_items(pytester, run_pytest):
    """Function, class and module markers pick the gang, closest first; several sizes make items."""
    pytester.makepyfile(
        test_sizes=RECORD
        + f"""
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.world_size(2)

def test_module_marker(world_size):
    record("module", world_size)

@pytest.mark.world_size(3)
def test_function_marker(world_size):
    record("function", world_size)

@pytest.mark.world_size(4)
class TestClassMarker:
    def test_class_marker(self, world_size):
        record("class", world_size)

    @pytest.mark.world_size(1)
    def test_method_marker(self, world_size):
        record("method", world_size)

@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("letter", ["a", "b"])
def test_sizes(letter, world_size):
    assert dist.get_world_size() == world_size
    record(f"sizes-{{letter}}", world_size)

@pytest.mark.world_size(1, "all")
def test_all(world_size):
    assert dist.get_world_size() == world_size
    record("all", world_size)

@pytest.mark.world_size({DEFAULT_SLOTS + 1})
def test_too_big():
    raise AssertionError("a gang larger than the devices must not run")
"""
    )
    result = run_pytest("-v", "-rs", "--strict-markers", "--megatron-timeout", "20")
    result.assert_outcomes(passed=12, skipped=1)
    result.stdout.fnmatch_lines_random(
        [f"*::test_sizes[[]ws{ws}-{letter}[]] PASSED*" for ws in (1, 2, 4) for letter in "ab"]
        + [
            "*::test_all[[]ws1[]] PASSED*",
            f"*::test_all[[]ws{DEFAULT_SLOTS}[]] PASSED*",
            f"SKIPPED [[]1[]] *: needs {DEFAULT_SLOTS + 1} devices, {DEFAULT_SLOTS} available",
        ]
    )
    sizes = recorded(pytester)
    assert sizes["module"] == [2]
    assert sizes["function"] == [3]
    assert sizes["class"] == [4]
    assert sizes["method"] == [1]
    assert sorted(sizes["sizes-a"]) == sorted(sizes["sizes-b"]) == [1, 2, 4]
    assert sorted(sizes["all"]) == [1, DEFAULT_SLOTS]


def test_devices_option_and_rank_environment(pytester, run_pytest):
    """--megatron-devices cpu:4 makes "all" four ranks and a gang of five impossible; each rank
    has torchrun's variables, its device block and an initialised gloo process group."""
    pytester.makepyfile(
        test_four=RECORD
        + """
import pytest
import torch.distributed as dist

@pytest.mark.world_size("all")
def test_all(world_size):
    record("all", world_size)

@pytest.mark.world_size(5)
def test_five():
    raise AssertionError("must be skipped")

@pytest.mark.world_size(2)
def test_env(rank, world_size):
    env = os.environ
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size) == (int(env["RANK"]), 2)
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["LOCAL_RANK"] == env["RANK"]
    assert env["GROUP_RANK"] == "0"
    assert env["XDIST_MEGATRON_DEVICES"] == "0,1"
    seen = [None, None]
    dist.all_gather_object(seen, (env["MASTER_ADDR"], env["MASTER_PORT"]))
    assert seen[0] == seen[1]
    assert seen[0][0] and int(seen[0][1]) > 0
"""
    )
    result = run_pytest("-rs", "--megatron-devices", "cpu:4", "--megatron-timeout", "20")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: needs 5 devices, 4 available"])
    assert recorded(pytester) == {"all": [4]}


def test_the_backend_option_is_the_ranks_backend(pytester, run_pytest, monkeypatch):
    """--megatron-backend is what the ranks' default group is made with (CPU default: gloo)."""
    pytester.makepyfile(
        test_backend="""
import os
import pytest
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_backend():
    assert dist.get_backend() == os.environ["EXPECTED_BACKEND"]
"""
    )
    for option, expected in (((), "gloo"), (("--megatron-backend", "cpu:gloo"), "cpu:gloo")):
        monkeypatch.setenv("EXPECTED_BACKEND", expected)
        run_pytest(*option, "--megatron-timeout", "20").assert_outcomes(passed=1)


MALFORMED = {"zero": "0", "negative": "-1", "text": '"x"', "float": "1.5", "empty": ""}


def test_malformed_marker_is_a_collection_error_naming_the_test(pytester, run_pytest):
    """Each bad size (and a marker without sizes) fails collection with the test's node id."""
    for name, args in MALFORMED.items():
        pytester.makepyfile(
            **{
                f"test_bad_{name}": f"""
import pytest

@pytest.mark.world_size({args})
def test_{name}():
    pass
"""
            }
        )
    result = run_pytest("--collect-only", "-q")
    result.assert_outcomes(errors=len(MALFORMED))
    result.stdout.fnmatch_lines_random(
        [f"*test_bad_{name}.py::test_{name}*world_size*" for name in MALFORMED]
    )


MISTAKES = {
    "layout_without_size": (
        "@pytest.mark.megatron(tp=2)\ndef test_it():\n    pass",
        "megatron needs a world size*",
    ),
    "tp_not_dividing": (
        "@pytest.mark.world_size(2)\n@pytest.mark.megatron(tp=3)\ndef test_it(rank):\n    pass",
        "megatron(tp=3) does not fit world size 2: tp*pp*cp = 3 must divide it",
    ),
    "ep_not_dividing": (
        "@pytest.mark.world_size(4)\n@pytest.mark.megatron(tp=2, ep=3)\n"
        "def test_it(rank):\n    pass",
        "megatron(tp=2, ep=3) does not fit world size 4: ep*tp*pp = 6 must divide it",
    ),
    "hidden_class_marker": (
        '@pytest.mark.world_size("abc")\nclass TestIt:\n'
        "    @pytest.mark.world_size(2)\n    def test_it(self, rank):\n        pass",
        "world_size expects positive ints or 'all', got 'abc'",
    ),
    "keyword_size": (
        "@pytest.mark.world_size(size=2)\ndef test_it(rank):\n    pass",
        "world_size takes sizes as positional arguments*not world_size(size=2)",
    ),
    "repeated_size": (
        "@pytest.mark.world_size(1, 1)\ndef test_it(rank):\n    pass",
        "world_size repeats 1: each size makes one test",
    ),
}


@pytest.mark.parametrize("mode", [(), ("-n", "2", "--dist", "megatron")], ids=["serial", "xdist"])
def test_marker_mistakes_are_collection_errors_before_any_gang_starts(pytester, run_pytest, mode):
    """A layout without a world size (it used to run in the driver), one that does not fit the
    size (it used to fail on the gang), a bad class marker under a good method marker (it used
    to pass), sizes given by keyword or twice: each a collection error naming the test."""
    pytester.makepyfile(
        **{f"test_{name}": f"import pytest\n\n{body}\n" for name, (body, _) in MISTAKES.items()}
    )
    result = run_pytest("--megatron-devices", "cpu:8", *mode)
    result.assert_outcomes(errors=len(MISTAKES))
    result.stdout.fnmatch_lines_random(
        [f"*test_{name}.py::*{message}*" for name, (_, message) in MISTAKES.items()]
    )
    assert result.ret != pytest.ExitCode.OK  # xdist reports collection errors with 1, pytest 2


@pytest.mark.parametrize("mode", [(), ("-n", "2", "--dist", "megatron")], ids=["serial", "xdist"])
def test_a_bad_devices_option_is_a_usage_error_in_every_mode(pytester, run_pytest, mode):
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = run_pytest("--megatron-devices", "garbage", *mode)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--megatron-devices 'garbage'*"])


def test_help_lists_options_in_one_group_and_the_marker(run_pytest):
    """`pytest --help` shows every `--megatron-*` option under one heading; `--markers` shows
    world_size."""
    lines = run_pytest("--help").stdout.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("xdist-megatron"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace())
    group = "\n".join(lines[start:end])
    for option in ("--megatron-timeout", "--megatron-devices", "--megatron-backend"):
        assert option in group
    declared = {line.split()[0].split("=")[0] for line in lines if line.startswith("  --megatron-")}
    listed = {line.split()[0].split("=")[0] for line in lines[start:end] if line.startswith("  --")}
    assert declared <= listed, declared - listed
    run_pytest("--markers").stdout.fnmatch_lines(["@pytest.mark.world_size(*sizes):*"])
