"""Inside an existing torchrun rank: run marked tests in-process instead of on a gang.

Megatron-LM's users run `torchrun --nproc-per-node N -m pytest`; there every rank runs the whole
session. Marked tests of size N then run right here, with the same fixtures, cleanup and
module-boundary reset as on a gang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .protocol import RankInfo
from .zygote import ZYGOTE_VAR

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """True in a process started by torchrun (and not in one of our own ranks)."""
    return all(v in os.environ for v in TORCHRUN_VARS) and ZYGOTE_VAR not in os.environ


def torchrun_rank_info() -> RankInfo | None:
    """This torchrun rank's RankInfo, or None outside torchrun."""
    if not under_torchrun():
        return None
    import torch

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device)


class TorchrunRank:
    """This process as one rank of torchrun's group: joined lazily, cleaned like a gang's rank."""

    def __init__(self) -> None:
        info = torchrun_rank_info()
        assert info is not None
        self.info = info
        self.world_size = info.world_size
        self._startup: Any = None
        self._module: str | None = None
        self._layout: Any = None

    def before_test(self, module: str, layout: Any) -> None:
        from . import layouts, state

        self._join()
        if self._module not in (None, module):
            self._layout = None
            state.cleanup_after_job()
            state.restore(self._startup)
        self._module = module
        kept, self._layout = self._layout, None
        self._layout = layouts.switch(layout, kept)

    def after_test(self) -> None:
        from . import state

        state.cleanup_after_job(keep_megatron=self._layout is not None)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """The `gang.run` of torchrun: call here, gather every rank's value."""
        import torch.distributed as dist

        self._join()
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, fn(*args, **kwargs))
        return values

    def _join(self) -> None:
        import torch
        import torch.distributed as dist

        # As on a gang: the devices of this node's ranks, so a test can tell where it ran.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        os.environ.setdefault("XDIST_MEGATRON_DEVICES", ",".join(map(str, range(local))))
        if dist.is_initialized():
            if self._startup is None:
                from . import state

                self._startup = state.snapshot()
            return
        if self.info.device.type == "cuda":
            torch.cuda.set_device(self.info.device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend)
        from . import state

        self._startup = state.snapshot()
