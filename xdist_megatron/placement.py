"""Devices and device blocks: pure functions, no torch and no xdist imports.

A run has a device set: GPUs (indices into the CUDA devices the session sees) or, in CPU mode,
numbered slots. A gang of size k occupies a block of k devices from that set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

CPU_PREFIX = "cpu:"
MIN_CPU_SLOTS = 8


@dataclass(frozen=True)
class DeviceSet:
    """The devices a run may place gangs on."""

    kind: str  # "cuda" or "cpu"
    ids: tuple[int, ...]
    physical: tuple[str, ...] = ()  # CUDA ids as the session saw them, for CUDA_VISIBLE_DEVICES
    workers: int = 0  # the xdist workers that share them (0: not known, or no xdist)
    gangs_per_device: int = 1  # how many gangs may hold one device at once

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def slots_for(self, exclusive: bool) -> int:
        """The slots of each of its devices a gang takes: one, or all for `exclusive_devices`."""
        return self.gangs_per_device if exclusive else 1

    def lock_name(self, device: int) -> str:
        """The name of a device's lock: the physical GPU, or the CPU slot."""
        if not self.is_cuda:
            return f"cpu-slot-{device}"
        return f"cuda-{self.physical[device] if self.physical else device}"

    def visible_devices(self, block: tuple[int, ...]) -> str:
        """CUDA_VISIBLE_DEVICES for a gang on `block` ("" in CPU mode: ranks see no GPU)."""
        if not self.is_cuda:
            return ""
        return ",".join(self.physical[i] if self.physical else str(i) for i in block)


def cpu_slots(cpu_count: int) -> int:
    """Default CPU-mode slot count: gloo ranks oversubscribe cores, so small machines get 8."""
    return max(MIN_CPU_SLOTS, cpu_count)


def parse_devices(
    spec: str | None, gpu_count: int, cpu_count: int, cuda_visible: str | None = None
) -> DeviceSet:
    """Parse `--megatron-devices` ("0,1,2,3", "cpu:8", or None for every GPU / CPU mode)."""
    physical = _split_visible(cuda_visible, gpu_count)
    if spec is None or not spec.strip():
        if gpu_count > 0:
            return DeviceSet("cuda", tuple(range(gpu_count)), physical)
        return DeviceSet("cpu", tuple(range(cpu_slots(cpu_count))))
    spec = spec.strip()
    if spec.startswith(CPU_PREFIX):
        count = _positive_int(spec[len(CPU_PREFIX) :], spec)
        return DeviceSet("cpu", tuple(range(count)))
    if spec == "cpu":
        return DeviceSet("cpu", tuple(range(cpu_slots(cpu_count))))
    ids = tuple(_non_negative_int(part, spec) for part in spec.split(","))
    if len(set(ids)) != len(ids):
        raise ValueError(f"--megatron-devices {spec!r} names a device twice")
    missing = [i for i in ids if i >= gpu_count]
    if missing:
        raise ValueError(
            f"--megatron-devices {spec!r}: device {missing[0]} does not exist ({gpu_count} visible)"
        )
    return DeviceSet("cuda", ids, physical)


def block_for(devices: DeviceSet, world_size: int, slot: int = 0) -> tuple[int, ...] | None:
    """The aligned block of `size` devices with index `slot`, or None when it does not fit."""
    start = slot * world_size
    if world_size < 1 or start + world_size > devices.count:
        return None
    return devices.ids[start : start + world_size]


def _split_visible(cuda_visible: str | None, gpu_count: int) -> tuple[str, ...]:
    if cuda_visible is None or not cuda_visible.strip():
        return tuple(str(i) for i in range(gpu_count))
    return tuple(part.strip() for part in cuda_visible.split(",") if part.strip())


def _positive_int(text: str, spec: str) -> int:
    value = _non_negative_int(text, spec)
    if value == 0:
        raise ValueError(f"--megatron-devices {spec!r}: need at least one device")
    return value


def _non_negative_int(text: str, spec: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"--megatron-devices {spec!r}: expected '0,1,2' or 'cpu:N'") from None
    if value < 0:
        raise ValueError(f"--megatron-devices {spec!r}: negative device {value}")
    return value


def gang_slot(worker: int, world_size: int, count: int, workers: int = 0) -> int | None:
    """Which aligned block of `world_size` devices worker `worker` uses (None when no block of
    that size fits).

    With the number of `workers` known, a worker's blocks nest, each inside its larger ones, so
    a worker that ran a large gang goes on with smaller ones on the same devices instead of
    waiting for another worker's: fewer workers than devices spread evenly over the blocks
    (worker j of W takes block j * blocks // W), as many or more take the block of their home
    device. Not known: the worker's own index when that block fits, else modulo the blocks."""
    blocks = count // world_size if world_size > 0 else 0
    if blocks == 0:
        return None
    if workers <= 0:
        return worker % blocks
    if workers >= count:
        return min((worker % count) // world_size, blocks - 1)
    return (worker % workers) * blocks // workers


def worker_block(devices: DeviceSet, worker: int, world_size: int) -> tuple[int, ...] | None:
    """The devices a gang of `size` ranks on worker `worker` runs on."""
    slot = gang_slot(worker, world_size, devices.count, devices.workers)
    return None if slot is None else block_for(devices, world_size, slot)


def home_device(devices: DeviceSet, worker: int) -> int:
    """The device a worker's unmarked tests run on."""
    return devices.ids[worker % devices.count]


def devices_of(devices: DeviceSet, worker: int, world_size: int | None) -> tuple[int, ...]:
    """Devices an item occupies while it runs: its gang's block, or the home device (size None)."""
    if world_size is None:
        return (home_device(devices, worker),)
    return worker_block(devices, worker, world_size) or ()


def positions(devices: DeviceSet, worker: int, world_size: int | None) -> frozenset[int]:
    """`devices_of`, as a set to compare and combine."""
    return frozenset(devices_of(devices, worker, world_size))


def to_dict(devices: DeviceSet) -> dict[str, object]:
    """A DeviceSet as plain data, to hand from the xdist controller to its workers."""
    return {
        "kind": devices.kind,
        "ids": list(devices.ids),
        "physical": list(devices.physical),
        "workers": devices.workers,
        "gangs_per_device": devices.gangs_per_device,
    }


def from_dict(data: dict) -> DeviceSet:
    return DeviceSet(
        data["kind"],
        tuple(data["ids"]),
        tuple(data["physical"]),
        data.get("workers", 0),
        data.get("gangs_per_device", 1),
    )


def shared_by(devices: DeviceSet, workers: int) -> DeviceSet:
    """The same devices, placed for `workers` xdist workers (`gang_slot`)."""
    return replace(devices, workers=workers)


def gangs_at_once(device_count: int, world_sizes: set[int], gangs_per_device: int = 1) -> int:
    """How many gangs can run side by side on `device_count` devices at the most, given the
    world sizes that will run (unknown, empty: as many as devices) and how many gangs may share
    a device."""
    return device_count // min(world_sizes, default=1) * gangs_per_device
