"""Where a serial plugin run's test phase goes, step by step, on the driver and on each rank.

As a pytest plugin (`-p step_times`, this folder on PYTHONPATH; the ranks load it too, they get
the driver's arguments) it wraps the plugin's per-test steps with timers and appends one JSON
line per call to $STEP_TIMES_DIR/<driver|rankN>-<pid>.jsonl. As a script it sums them up:

  STEP_TIMES_DIR=/tmp/steps python3 -m pytest tests/unit_tests --megatron-world-size 2 -p step_times
  python3 step_times.py /tmp/steps

A diagnosis tool: it patches private functions, so it follows the plugin's code, not an API.
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

FOLDER = os.environ.get("STEP_TIMES_DIR", "/tmp/step_times")
ON_RANK_VAR = "XDIST_MEGATRON_DEVICES"  # in a rank's environment, not in the driver's


def _file() -> str:
    role = f"rank{os.environ.get('RANK', '?')}" if os.environ.get(ON_RANK_VAR) else "driver"
    return os.path.join(FOLDER, f"{role}-{os.getpid()}.jsonl")


def _timed(owner: Any, attribute: str, step: str, detail: Callable[..., Any] | None = None) -> None:
    original = getattr(owner, attribute)
    if getattr(original, "step_times", False):  # already wrapped (in the zygote, say)
        return

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            line = {"step": step, "start": start, "end": time.time()}
            if detail is not None:
                line["detail"] = detail(*args, **kwargs)
            os.makedirs(FOLDER, exist_ok=True)
            with open(_file(), "a") as out:  # at once: a rank ends with os._exit
                out.write(json.dumps(line) + "\n")

    timed.step_times = True  # type: ignore[attr-defined]
    setattr(owner, attribute, timed)


def _job_kind(self: Any, job: Any, *args: Any) -> str:
    return type(job).__name__


def install() -> None:
    from xdist_megatron.driver import dispatch, gang, pool
    from xdist_megatron.ranks import inprocess, isolation, rank, rank_session

    _timed(dispatch.GangDispatch, "pytest_runtest_protocol", "driver: test protocol")
    _timed(gang.Gang, "execute", "driver: job on the gang", _job_kind)
    _timed(pool.GangPool, "acquire", "driver: acquire (module reset)")
    _timed(rank._JobRunner, "run", "rank: job", _job_kind)
    _timed(rank._JobRunner, "_open_session", "rank: open session")
    _timed(rank._JobRunner, "_reset", "rank: module reset")
    _timed(rank._JobRunner, "_repin_device", "rank: device check")
    _timed(rank._JobRunner, "_repair_default_group", "rank: default group check")
    _timed(rank, "_check_health", "rank: health barrier")
    _timed(rank, "finish_line", "rank: finish line")
    _timed(rank_session.RankSession, "run", "rank: test protocol")
    _timed(rank_session.RankSession, "_collect_module", "rank: collect module")
    _timed(isolation, "cleanup_after_job", "rank: cleanup")
    _timed(isolation.gc, "collect", "gc.collect, any caller")
    _timed(isolation, "_teardown_megatron", "rank: megatron reset")
    _timed(isolation, "_destroy_process_groups", "rank: destroy groups")
    _timed(inprocess.InProcessRank, "reset", "rank: state reset")


def summary(folder: str) -> str:
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        calls: dict[str, list[float]] = collections.defaultdict(list)
        for line in map(json.loads, open(path)):
            name = line["step"] + (f" ({line['detail']})" if "detail" in line else "")
            calls[name].append(line["end"] - line["start"])
        lines.append(f"\n{os.path.basename(path)}")
        lines.append(f"  {'step':44} {'calls':>5} {'total s':>8} {'mean ms':>8}")
        for name, times in sorted(calls.items(), key=lambda item: -sum(item[1])):
            mean = 1000 * sum(times) / len(times)
            lines.append(f"  {name:44} {len(times):5} {sum(times):8.2f} {mean:8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1] if len(sys.argv) > 1 else FOLDER))
else:
    install()
