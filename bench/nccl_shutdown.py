"""What destroying megatron's process groups costs on GPUs: one at a time, shut down on threads
first (what the plugin's cleanup does), or aborted first; for lazily and eagerly initialised NCCL
communicators.

    torchrun --nproc-per-node 2 bench/nccl_shutdown.py [--backend nccl|cpu:gloo,cuda:nccl] [--eager]

Needs 2 GPUs and megatron-core. Prints, per case, the seconds each way for the groups of 7
`initialize_model_parallel` calls (tensor-parallel size 1 and 2 alternating), with and without a
collective on two of each call's groups (which makes NCCL create their communicators).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

ROUNDS = 7
THREADS = 16


def make_groups(use: bool) -> list[object]:
    """The groups megatron leaves registered after ROUNDS initialisations."""
    for i in range(ROUNDS):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1 + i % 2)
        if use:
            t = torch.ones(1, device="cuda")
            dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
            torch.cuda.synchronize()
        parallel_state.destroy_model_parallel()
    world = dist.distributed_c10d._world
    return [group for group in world.pg_map if group is not world.default_pg]


def destroy_all(groups: list[object]) -> None:
    """destroy_process_group on each (it shuts down any not shut down yet); `groups` is emptied
    (no loop variable: it would keep the last group alive)."""
    for index in range(len(groups)):
        dist.destroy_process_group(groups[index])
    groups.clear()


def one_at_a_time(groups: list[object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    destroy_all(groups)
    return time.perf_counter() - start


def on_threads(groups: list[object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    shares = [groups[i::THREADS] for i in range(THREADS)]
    threads = [
        threading.Thread(target=lambda share=share: [g.shutdown() for g in share])
        for share in shares
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    destroy_all(groups)
    return time.perf_counter() - start


def aborted_first(groups: list[object]) -> float:
    """ProcessGroup.abort (ncclCommAbort: local, no wait for peers) once every rank is idle,
    then the bookkeeping of destroy_process_group."""
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for group in groups:
        group.abort()
    destroy_all(groups)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--eager", action="store_true", help="init_process_group(device_id=...)")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device_id = {"device_id": torch.device("cuda", local_rank)} if args.eager else {}
    dist.init_process_group(args.backend, **device_id)
    rows = []
    for use in (False, True):
        count = len(groups := make_groups(use))
        alone = one_at_a_time(groups)
        together = on_threads(make_groups(use))
        aborted = aborted_first(make_groups(use))
        rows.append((use, count, alone, together, aborted))
    if dist.get_rank() == 0:
        print(f"backend {args.backend}, eager communicators: {args.eager}")
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
