"""How long a rank gang takes to start, and what a no-op world_size(2) test costs.

Process start-up dominates the GPU test lanes of Megatron-style projects (DESIGN.md, "The problem").
This benchmark backs docs/benchmarks.md's numbers with two measurements:

1. Gang start per world size: cold is a torchrun-style gang (N fresh interpreters that import torch
   and megatron.core and join a gloo group through a TCPStore this process owns); warm is
   `Gang(world_size=N, zygote=z).start()` from a zygote that preloaded the same modules, up to
   one all_reduce done on every rank (NCCL on GPUs: the CUDA context and communicator included).
2. Per-test time of no-op tests in one pytest run, from its junit XML: world_size(2) tests against
   unmarked ones; the difference is what the plugin adds to every distributed test.

Sizes larger than the devices (`--devices`) are left out of both parts, and the report says so;
on one device the per-test suite uses world_size(1). Run `python bench/gang_start.py --help` for
the options. Progress goes to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import IO, Any

from _util import (
    BenchmarkError,
    Devices,
    add_devices_option,
    device_set,
    header_lines,
    importable,
    left_out_line,
    machine,
    passed_times,
    progress,
    resolve_devices,
    run_junit_suite,
    summarize,
    table,
    write_ini,
    write_record,
    zygote_client,
)

LOCALHOST = "127.0.0.1"
START_TIMEOUT = 300.0  # a spawned gang of 8 importing megatron.core needs over a minute on 2 cores
STOP_TIMEOUT = 30.0
IMPORTS_VAR = "GANG_START_IMPORTS"
BASE_MODULES = ["torch", "torch.distributed"]
MEGATRON = "megatron.core"
TRANSFORMER_ENGINE = "transformer_engine.pytorch"
SUITE_FILE = "test_noop.py"
PER_TEST_SIZE = 2  # the world size of the per-test suite's marked tests, where it fits
TARGET_WARM_S = 0.1
TARGET_SPEEDUP_WS4 = 100.0
TARGET_OVERHEAD_MS = 5.0


@dataclass(frozen=True)
class Settings:
    sizes: list[int]  # the asked sizes that fit the devices
    repeats: int
    cold_repeats: int
    tests: int
    use_megatron: bool
    use_te: bool
    json_path: str | None
    devices: Devices
    left_out: list[str]  # why each asked size that does not fit was left out
    per_test_size: int  # PER_TEST_SIZE, or 1 where it does not fit


# -- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="warm starts per size (default 5, quick 2)")
    parser.add_argument(
        "--cold-repeats", type=int, help="cold starts per size (default min(3, repeats), quick 1)"
    )
    parser.add_argument("--sizes", help="world sizes, e.g. 1,2,4,8 (the default; quick 1,2,4)")
    parser.add_argument(
        "--tests", type=int, help="no-op tests of each kind in the suite (default 200, quick 100)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats, sizes and tests")
    parser.add_argument(
        "--no-megatron", action="store_true", help="leave megatron.core out of both gangs"
    )
    parser.add_argument(
        "--with-te",
        action="store_true",
        help=f"add {TRANSFORMER_ENGINE} to both gangs' imports where it is installed",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    add_devices_option(parser)
    parser.add_argument("--cold-rank", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Explicit options win; --quick only changes the defaults. Sizes that do not fit the
    devices are left out, with the reason."""
    sizes_text = args.sizes or ("1,2,4" if args.quick else "1,2,4,8")
    sizes = [int(s) for s in sizes_text.split(",") if s.strip()]
    repeats = args.repeats or (2 if args.quick else 5)
    cold_repeats = args.cold_repeats or (1 if args.quick else min(3, repeats))
    tests = args.tests or (100 if args.quick else 200)
    if min(sizes, default=0) < 1 or repeats < 1 or cold_repeats < 1 or tests < 2:
        raise SystemExit("sizes and repeats must be >= 1, --tests >= 2")
    devices = resolve_devices(args.devices)
    kept, left_out = devices.fitting(sizes)
    per_test_size = PER_TEST_SIZE if devices.count >= PER_TEST_SIZE else 1
    if per_test_size != PER_TEST_SIZE:
        left_out.append(
            f"per-test suite at ws{PER_TEST_SIZE}: {devices.shortfall(PER_TEST_SIZE)}; "
            f"its marked tests are world_size({per_test_size})"
        )
    return Settings(
        kept, repeats, cold_repeats, tests, not args.no_megatron, args.with_te, args.json, devices,
        left_out, per_test_size,
    )  # fmt: skip


# -- cold: a torchrun-style spawned gang ----------------------------------------------------------


def cold_rank() -> int:
    """Body of one spawned rank: what a torchrun child does before its first test can run."""
    for name in os.environ[IMPORTS_VAR].split(","):
        importlib.import_module(name)
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=START_TIMEOUT),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    print("ready", flush=True)
    sys.stdin.read()  # the benchmark closes our stdin once it has timed the gang
    dist.destroy_process_group()
    return 0


def rank_env(rank: int, size: int, port: int, modules: list[str]) -> dict[str, str]:
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR=LOCALHOST,
        MASTER_PORT=str(port),
        **{IMPORTS_VAR: ",".join(modules)},
    )
    if size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, and what the gang's ranks do
    return env


def time_cold_gang(size: int, modules: list[str], log: IO[bytes]) -> float:
    """Seconds from creating the store to every spawned rank being in the process group."""
    import torch.distributed as dist

    start = time.perf_counter()
    store = dist.TCPStore(
        LOCALHOST, 0, None, True, timedelta(seconds=START_TIMEOUT), wait_for_workers=False
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(size):
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--cold-rank"],
                    env=rank_env(rank, size, store.port, modules),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            )
        await_ready(procs, log)
        return time.perf_counter() - start
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        stop(procs)


def await_ready(procs: list[subprocess.Popen[bytes]], log: IO[bytes]) -> None:
    """Wait for every rank's "ready" line; a rank that exits first is an error with its log."""
    deadline = time.monotonic() + START_TIMEOUT
    with selectors.DefaultSelector() as selector:
        for rank, proc in enumerate(procs):
            selector.register(proc.stdout, selectors.EVENT_READ, rank)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchmarkError(
                    f"spawned gang of {len(procs)} not ready within {START_TIMEOUT:.0f} s"
                    f"\n{log_tail(log)}"
                )
            for key, _ in selector.select(remaining):
                line = key.fileobj.readline()
                if not line:
                    raise BenchmarkError(
                        f"spawned rank {key.data} of {len(procs)} exited with code "
                        f"{procs[key.data].wait(STOP_TIMEOUT)} before joining the group\n"
                        f"{log_tail(log)}"
                    )
                if line.strip() == b"ready":
                    selector.unregister(key.fileobj)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """End the ranks by closing their stdin; kill any that do not exit in time."""
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def log_tail(log: IO[bytes], lines: int = 20) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace").splitlines()[-lines:]
    return "output of the processes:\n" + "\n".join(text)


# -- warm: a gang forked from the zygote ----------------------------------------------------------


def start_zygote(
    modules: list[str], log: IO[bytes], standby: int, devices: Devices
) -> tuple[Any, float]:
    """A zygote that keeps `standby` ranks forked, as the plugin's does in a serial run; the time
    until its imports are done."""
    start = time.perf_counter()
    zygote = zygote_client(modules, log, standby=standby, cuda=not devices.is_cpu)
    zygote.preload_failures  # noqa: B018 - waits until the zygote is ready
    return zygote, time.perf_counter() - start


def time_warm_gang(zygote: Any, size: int, devices: Any, workdir: str) -> float:
    """Seconds from asking for a gang to every rank having finished one all_reduce on its
    device (NCCL on GPUs): the fork from the zygote, the rendezvous, the rank's CUDA context and
    the first communicator."""
    # Imported here: spawned ranks run this file and must import only what they are timed on.
    from xdist_megatron import Gang

    start = time.perf_counter()
    # workdir: a standalone Gang otherwise leaves one temporary folder per start behind.
    gang = Gang(world_size=size, devices=devices, zygote=zygote, workdir=workdir)
    try:
        gang.start()
        gang.run(all_reduce_once)
        return time.perf_counter() - start
    finally:
        gang.close()


def all_reduce_once() -> None:
    """On each rank: one all_reduce of a tensor on the rank's device, waited for."""
    import torch
    import torch.distributed as dist

    from xdist_megatron import rank_info

    tensor = torch.ones(1, device=rank_info().device)
    dist.all_reduce(tensor)
    tensor.item()


# -- part 1: gang start ---------------------------------------------------------------------------


def candidate_modules(settings: Settings) -> tuple[list[str], str]:
    """The heavy modules both kinds of gang import, and a note on megatron.core (and TE)."""
    modules, notes = list(BASE_MODULES), []
    for name, wanted, why_not in [
        (MEGATRON, settings.use_megatron, "left out by --no-megatron"),
        (TRANSFORMER_ENGINE, settings.use_te, "left out: no --with-te"),
    ]:
        if not wanted:
            notes.append(f"{name} {why_not}")
        elif not importable(name):
            notes.append(f"{name} not importable: measured without it")
        else:
            modules.append(name)
            notes.append(f"{name} imported by cold ranks, preloaded by the zygote")
    return modules, "; ".join(notes)


def measure_gang_start(settings: Settings, workdir: str, log: IO[bytes]) -> dict[str, Any]:
    import torch.distributed  # noqa: F401 - the driver's own import is no part of a gang start

    modules, note = candidate_modules(settings)
    progress(f"zygote: preloading {', '.join(modules)}")
    standby = max(settings.sizes, default=0)
    zygote, zygote_s = start_zygote(modules, log, standby, settings.devices)
    devices = device_set(settings.devices)
    try:
        failed = {m: why for m, why in zygote.preload_failures.items() if m in modules}
        if failed:
            modules = [m for m in modules if m not in failed]
            note = "; ".join(f"{m} left out, not importable: {why}" for m, why in failed.items())
        warm = {
            size: repeat(
                f"warm ws{size}", settings.repeats, time_warm_gang, zygote, size, devices, workdir
            )
            for size in settings.sizes
        }
    finally:
        zygote.close()
    cold = {
        size: repeat(f"cold ws{size}", settings.cold_repeats, time_cold_gang, size, modules, log)
        for size in settings.sizes
    }
    rows = [size_row(size, cold[size], warm[size]) for size in settings.sizes]
    return {"modules": modules, "megatron": note, "zygote_start_s": zygote_s, "sizes": rows}


def size_row(size: int, cold: list[float], warm: list[float]) -> dict[str, Any]:
    cold_s, warm_s = summarize(cold), summarize(warm)
    return {
        "size": size,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "ratio": cold_s["median"] / warm_s["median"],
    }


def repeat(label: str, times: int, measure: Any, *args: Any) -> list[float]:
    samples = []
    for run in range(1, times + 1):
        samples.append(measure(*args))
        progress(f"{label} run {run}/{times}: {samples[-1]:.3f} s")
    return samples


# -- part 2: per-test overhead --------------------------------------------------------------------


def write_suite(folder: str, count: int, size: int, preload: list[str]) -> None:
    """`count` no-op world_size(size) tests interleaved with `count` plain ones, so drift hits
    both."""
    write_ini(folder, ["megatron_preload =", *(f"    {m}" for m in preload)])
    parts = ["import pytest\n"]
    for i in range(count):
        parts.append(
            f"\n\n@pytest.mark.world_size({size})\ndef test_marked_{i:04d}():\n    pass\n"
            f"\n\ndef test_plain_{i:04d}():\n    pass\n"
        )
    with open(os.path.join(folder, SUITE_FILE), "w") as f:
        f.write("".join(parts))


def measure_per_test(settings: Settings, preload: list[str]) -> dict[str, Any]:
    count, size = settings.tests, settings.per_test_size
    with tempfile.TemporaryDirectory(prefix="gang-start-suite-") as folder:
        write_suite(folder, count, size, preload)
        label = f"suite: {count} world_size({size}) + {count} plain no-op tests"
        options = settings.devices.plugin_options()
        timeout = START_TIMEOUT + 30 * count
        junit, wall = run_junit_suite(folder, SUITE_FILE, options, label, timeout)
        cases = passed_times(junit)
    marked = [seconds for name, seconds in cases if name.startswith("test_marked_")]
    plain = [seconds for name, seconds in cases if name.startswith("test_plain_")]
    if len(marked) != count or len(plain) != count:
        got = f"{len(marked)} and {len(plain)}"
        raise BenchmarkError(f"expected {count} tests of each kind, got {got}")
    marked_ms = summarize([t * 1000 for t in marked[1:]])  # the first starts the zygote and gang
    plain_ms = summarize([t * 1000 for t in plain])
    return {
        "tests_per_kind": count,
        "size": size,
        "preload": preload,
        "wall_s": wall,
        "first_test_ms": marked[0] * 1000,
        "marked_ms": marked_ms,
        "plain_ms": plain_ms,
        "overhead_ms": {q: marked_ms[q] - plain_ms[q] for q in ("median", "p90")},
    }


# -- report ---------------------------------------------------------------------------------------


def gang_table(start: dict[str, Any], settings: Settings) -> str:
    headers = [
        "size",
        "cold p50",
        "cold min",
        "cold max",
        "warm p50",
        "warm min",
        "warm max",
        "cold/warm",
    ]
    rows = []
    for row in start["sizes"]:
        cells = [f"{row[k][q]:.3f}" for k in ("cold_s", "warm_s") for q in ("median", "min", "max")]
        rows.append([f"ws{row['size']}", *cells, f"{row['ratio']:.0f}x"])
    title = (
        f"Gang start [s]  (runs per size: cold {settings.cold_repeats}, warm {settings.repeats}; "
        "cold: ranks in the process group; warm: and one all_reduce done)"
    )
    return f"{title}\n{table(headers, rows)}"


def per_test_table(per_test: dict[str, Any]) -> str:
    marked, plain, overhead = per_test["marked_ms"], per_test["plain_ms"], per_test["overhead_ms"]
    size = per_test["size"]
    rows = [
        [f"world_size({size}), first excluded", str(marked["n"]), *ms_cells(marked)],
        ["plain", str(plain["n"]), *ms_cells(plain)],
        [f"overhead (ws{size} - plain)", "", *ms_cells(overhead)],
    ]
    title = (
        f"Per-test time of a no-op test [ms]  (one pytest run of {per_test['tests_per_kind']} "
        f"tests of each kind, wall {per_test['wall_s']:.1f} s;\n"
        "junit time = setup + call + teardown, written with 1 ms resolution)"
    )
    first = (
        f"first-test cost (zygote start + gang start + the test): "
        f"{per_test['first_test_ms']:.1f} ms"
    )
    return f"{title}\n{table(['test', 'n', 'p50', 'p90'], rows)}\n{first}"


def ms_cells(summary: dict[str, Any]) -> list[str]:
    return [f"{summary['median']:.2f}", f"{summary['p90']:.2f}"]


def targets(start: dict[str, Any], per_test: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims of docs/benchmarks.md, each with what this run measured (None: not measured)."""
    by_size = {row["size"]: row for row in start["sizes"]}
    small = [row["warm_s"]["median"] for size, row in by_size.items() if size <= 4]
    return [
        {
            "target": f"warm start p50 <= {TARGET_WARM_S} s for sizes <= 4",
            "measured": f"{max(small):.3f} s (worst)" if small else None,
            "met": max(small) <= TARGET_WARM_S if small else None,
        },
        {
            "target": f"warm >= {TARGET_SPEEDUP_WS4:.0f}x faster than cold at ws4",
            "measured": f"{by_size[4]['ratio']:.0f}x" if 4 in by_size else None,
            "met": by_size[4]["ratio"] >= TARGET_SPEEDUP_WS4 if 4 in by_size else None,
        },
        {
            "target": f"no-op ws{per_test['size']} overhead p50 <= {TARGET_OVERHEAD_MS:.0f} ms",
            "measured": f"{per_test['overhead_ms']['median']:.2f} ms",
            "met": per_test["overhead_ms"]["median"] <= TARGET_OVERHEAD_MS,
        },
    ]


def targets_table(checks: list[dict[str, Any]]) -> str:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    rows = [[c["target"], c["measured"] or "-", verdict[c["met"]]] for c in checks]
    return "Targets\n" + table(["target", "measured", "verdict"], rows)


def report(
    settings: Settings,
    info: dict[str, Any],
    start: dict[str, Any],
    per_test: dict[str, Any],
    checks: list[dict[str, Any]],
) -> str:
    lines = header_lines("xdist-megatron benchmark: gang start and per-test overhead", info)
    lines += [
        f"modules : {', '.join(start['modules'])} ({start['megatron']})",
        f"devices : {settings.devices.describe()}",
        left_out_line(settings.left_out),
        "",
        f"Zygote start (preloads the modules above and the plugin's own): "
        f"{start['zygote_start_s']:.2f} s, once per driver",
        "",
        gang_table(start, settings),
        "",
        per_test_table(per_test),
        "",
        targets_table(checks),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cold_rank:
        return cold_rank()
    settings = resolve_settings(args)
    info = machine()
    with (
        tempfile.TemporaryDirectory(prefix="gang-start-") as workdir,
        open(os.path.join(workdir, "processes.log"), "w+b") as log,
    ):
        start = measure_gang_start(settings, workdir, log)
    per_test = measure_per_test(settings, start["modules"])
    checks = targets(start, per_test)
    print(report(settings, info, start, per_test, checks))
    write_record(
        settings.json_path, info, settings=asdict(settings), gang_start=start,
        per_test=per_test, targets=checks,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
