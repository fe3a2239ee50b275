"""What destroying megatron's process groups costs: one at a time, shut down on threads first
(what the plugin's cleanup does), or aborted first; for lazily and eagerly initialised NCCL
communicators.

    torchrun --nproc-per-node 2 bench/nccl_shutdown.py [--backend nccl|cpu:gloo,cuda:nccl] [--eager]

Needs megatron-core. On GPUs (one rank per GPU) it measures NCCL; with `--device cpu` (the default
without a GPU) the same code paths on gloo. Prints, per case, the seconds each way for the groups
of 7 (`--rounds`) `initialize_model_parallel` calls (tensor-parallel size 1 and 2 alternating),
with and without a collective on two of each call's groups (which makes NCCL create their
communicators). What the ranks cannot do (tp=2 with one rank, eager communicators on CPU) is left
out, and said so.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _util import left_out_line
from megatron.core import parallel_state

ROUNDS = 7
THREADS = 16
TP_SIZES = (1, 2)  # alternating, so that each round builds groups the previous one did not


def fitting_tp_sizes(world_size: int) -> tuple[list[int], list[str]]:
    """The tensor-parallel sizes these ranks can initialise, and why any other was left out."""
    kept = [tp for tp in TP_SIZES if world_size % tp == 0]
    short = [tp for tp in TP_SIZES if tp not in kept]
    return kept, [f"tp={tp}: needs a multiple of {tp} ranks, {world_size} running" for tp in short]


def make_groups(use: bool, tp_sizes: list[int], device: torch.device, rounds: int) -> list[object]:
    """The groups megatron leaves registered after `rounds` initialisations."""
    for i in range(rounds):
        tp = tp_sizes[i % len(tp_sizes)]
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        if use:
            t = torch.ones(1, device=device)
            dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
            synchronize(device)
        parallel_state.destroy_model_parallel()
    world = dist.distributed_c10d._world
    return [group for group in world.pg_map if group is not world.default_pg]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def destroy_all(groups: list[object]) -> None:
    """destroy_process_group on each (it shuts down any not shut down yet); `groups` is emptied
    (no loop variable: it would keep the last group alive)."""
    for index in range(len(groups)):
        dist.destroy_process_group(groups[index])
    groups.clear()


Way = Callable[[list[object]], None]  # what is done to the groups before they are destroyed


def timed(first: Way, groups: list[object], device: torch.device) -> float:
    """Seconds of `first` and the destruction after it, from a point where every rank is idle."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    first(groups)
    destroy_all(groups)
    return time.perf_counter() - start


def nothing(groups: list[object]) -> None:
    """One at a time: destroy_process_group alone."""


def shut_down_on_threads(groups: list[object]) -> None:
    shares = [groups[i::THREADS] for i in range(THREADS)]
    threads = [
        threading.Thread(target=lambda share=share: [g.shutdown() for g in share])
        for share in shares
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def abort_each(groups: list[object]) -> None:
    """ProcessGroup.abort (ncclCommAbort: local, no wait for peers), then the bookkeeping of
    destroy_process_group."""
    for group in groups:
        group.abort()


WAYS: tuple[Way, ...] = (nothing, shut_down_on_threads, abort_each)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--eager", action="store_true", help="init_process_group(device_id=...)")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"initialisations per case (default {ROUNDS})"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the ranks work (default: cuda where a GPU is visible)",
    )
    return parser.parse_args()


def init(args: argparse.Namespace, local_rank: int) -> tuple[torch.device, list[str]]:
    """Join the default group on this rank's device; what was left out of the settings."""
    left_out = []
    if args.device == "cpu":
        device = torch.device("cpu")
        if args.eager:
            left_out.append("--eager: eager communicators are NCCL's, not on CPU")
        dist.init_process_group(args.backend or "gloo")
        return device, left_out
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        raise SystemExit(f"rank {local_rank} needs GPU {local_rank}, {gpus} visible: "
                         f"start at most {gpus} ranks per node (or --device cpu)")  # fmt: skip
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend or "nccl", **({"device_id": device} if args.eager else {}))
    return device, left_out


def measure(use: bool, tp_sizes: list[int], device: torch.device, rounds: int) -> tuple:
    """(use, groups, seconds of each way): each way destroys groups of its own."""
    times = []
    for way in WAYS:
        groups = make_groups(use, tp_sizes, device, rounds)
        count = len(groups)
        times.append(timed(way, groups, device))
    return (use, count, *times)


def main() -> None:
    args = parse_args()
    device, left_out = init(args, int(os.environ["LOCAL_RANK"]))
    tp_sizes, skipped = fitting_tp_sizes(dist.get_world_size())
    rows = [measure(use, tp_sizes, device, args.rounds) for use in (False, True)]
    if dist.get_rank() == 0:
        eager = args.eager and device.type == "cuda"
        print(f"backend {dist.get_backend()} on {device.type}, {dist.get_world_size()} ranks, "
              f"tp sizes {tp_sizes}, eager communicators: {eager}")  # fmt: skip
        print(left_out_line(skipped + left_out))
        print("collectives  groups  one at a time  shut down on threads first  aborted first")
        for use, count, alone, together, aborted in rows:
            used = "yes" if use else "no"
            print(
                f"{used:>11}  {count:>6}  {alone:>11.2f} s  {together:>24.2f} s  {aborted:>11.2f} s"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
