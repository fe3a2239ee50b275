"""Messages between the driver and its ranks (pickled over one socket per rank).

Kept free of heavy imports: the zygote and the ranks import it before any test code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .explain import ExplainSettings


class RankInfo(NamedTuple):
    """Where the calling code runs: returned by `xdist_megatron.rank_info()`."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device


@dataclass(frozen=True)
class RankSpec:
    """What the zygote needs to turn a fork into rank `rank` of a gang."""

    rank: int
    world_size: int
    env: dict[str, str]
    backend: str
    store_host: str
    store_port: int
    use_cuda: bool
    driver_pid: int
    stack_path: str
    start_timeout: float


@dataclass(frozen=True)
class TestJob:
    """Run one test function's body on a rank."""

    nodeid: str
    module_name: str
    module_path: str
    sys_path: list[str]
    class_path: str | None  # qualified class name inside the module, or None
    function_name: str
    fixtures: bytes  # pickled {name: value} of the driver-resolved arguments
    native_names: tuple[str, ...]  # rank-native fixtures the function takes
    tbstyle: str
    showlocals: bool
    capture: bool
    teardown_class: bool  # run teardown_class after this test (the class ends here)
    layout: tuple | None = None  # Megatron layout of @pytest.mark.megatron, kept between tests
    explain: ExplainSettings = ExplainSettings()  # how to explain a failed comparison


@dataclass(frozen=True)
class CallJob:
    """Call a pickled (fn, args, kwargs) on a rank: `gang.run` and the standalone Gang."""

    payload: bytes
    sys_path: list[str] = field(default_factory=list)
    main_path: str | None = None  # the driver's __main__ script, for functions defined there


@dataclass(frozen=True)
class CleanupJob:
    """The per-job cleanup, for jobs that did not run it themselves (explicit gang style)."""


@dataclass(frozen=True)
class ResetJob:
    """Module boundary: restore the state each rank recorded right after it started."""


@dataclass(frozen=True)
class ShutdownJob:
    """Leave the process group and exit."""


Job = TestJob | CallJob | CleanupJob | ResetJob | ShutdownJob

PASSED, FAILED, SKIPPED, XFAILED = "passed", "failed", "skipped", "xfailed"


@dataclass
class RankResult:
    """What one rank reports for one job."""

    rank: int
    outcome: str  # PASSED, FAILED, SKIPPED or XFAILED
    message: str = ""  # one line: the exception, or the skip/xfail reason
    longrepr: Any = None  # pytest's failure representation (or text) for failures
    crash: tuple[str, int] | None = None  # (path, lineno) of the failure
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    value: Any = None  # CallJob return value
    final: bool = True  # False: the test body's outcome, sent before the collective cleanup


@dataclass(frozen=True)
class Ready:
    """First message of a rank: it joined the process group."""

    rank: int
    pid: int
