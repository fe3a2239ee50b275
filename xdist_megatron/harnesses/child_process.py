"""On a rank: the process state a harness's spawned child starts from. It inherits its
parent's environment (a rank's own has torchrun's variables, among them
TORCHELASTIC_USE_AGENT_STORE, which would send the child's own rendezvous to a store nobody
serves) and creates its default group itself: the gang's stands for it where its backend serves
the child's, else gives way (the per-job cleanup restores it afterwards)."""

from __future__ import annotations

from ..protocol import ZYGOTE_VAR
from ..ranks.isolation import restore_environ

KEPT_VARIABLES = ("CUDA_VISIBLE_DEVICES", ZYGOTE_VAR)  # the rank's devices, the plugin's own
KEPT_PREFIXES = ("XDIST_MEGATRON_",)


def take_parent_environment(parent: dict[str, str], own: dict[str, str]) -> None:
    """The parent's environment in place of the rank's `own`, but for the rank's devices and
    the plugin's variables."""
    kept = {
        name: value
        for name, value in own.items()
        if name in KEPT_VARIABLES or name.startswith(KEPT_PREFIXES)
    }
    restore_environ({**parent, **kept})


def gang_group_serves(backend: str) -> bool:
    """Whether the rank's default group is one of `backend` ("gloo" is served by the gang's
    "gloo" and by its "cpu:gloo,cuda:nccl")."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    kinds = {part.split(":")[-1] for part in str(dist.get_backend()).split(",")}
    return backend.lower() in kinds


def destroy_default_group() -> None:
    """Take the default group down, with no collective: the gang's, for a child that creates
    its own; the child's own, when its part ends (a peer that failed left its own)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
