"""Table-driven checks of placement.py: which devices a run gets and which block a gang takes."""

from __future__ import annotations

import pytest

from xdist_megatron.placement import (
    DeviceSet,
    block_for,
    from_dict,
    gang_slot,
    parse_devices,
    shared_by,
    to_dict,
    worker_block,
)

CPU8 = DeviceSet("cpu", tuple(range(8)))


@pytest.mark.parametrize(
    ("spec", "gpus", "cores", "visible", "expected"),
    [
        ("0,1,2,3", 4, 2, None, DeviceSet("cuda", (0, 1, 2, 3), ("0", "1", "2", "3"))),
        ("2, 0", 4, 2, None, DeviceSet("cuda", (2, 0), ("0", "1", "2", "3"))),
        ("cpu:8", 4, 2, None, DeviceSet("cpu", tuple(range(8)))),
        (" cpu:3 ", 0, 2, None, DeviceSet("cpu", (0, 1, 2))),
        ("cpu", 4, 2, None, DeviceSet("cpu", tuple(range(8)))),
        ("cpu", 0, 16, None, DeviceSet("cpu", tuple(range(16)))),
        (None, 2, 2, None, DeviceSet("cuda", (0, 1), ("0", "1"))),
        ("", 2, 2, None, DeviceSet("cuda", (0, 1), ("0", "1"))),
        (None, 0, 2, None, DeviceSet("cpu", tuple(range(8)))),
        (None, 0, 12, None, DeviceSet("cpu", tuple(range(12)))),
        (None, 2, 2, "5,7", DeviceSet("cuda", (0, 1), ("5", "7"))),
        ("1", 2, 2, " 5 , 7 ", DeviceSet("cuda", (1,), ("5", "7"))),
        (None, 1, 2, "GPU-a1b2", DeviceSet("cuda", (0,), ("GPU-a1b2",))),
    ],
)
def test_parse_devices(spec, gpus, cores, visible, expected):
    """Explicit lists, CPU slots (at least 8 by default) and the GPU default, with physical ids."""
    assert parse_devices(spec, gpus, cores, visible) == expected


@pytest.mark.parametrize(
    ("spec", "gpus", "message"),
    [
        ("0,1,0", 4, "names a device twice"),
        ("-1", 4, "negative device -1"),
        ("0,-2", 4, "negative device -2"),
        ("cpu:-2", 0, "negative device -2"),
        ("4", 4, "device 4 does not exist (4 visible)"),
        ("0", 0, "device 0 does not exist (0 visible)"),
        ("cpu:0", 0, "need at least one device"),
        ("gpu0", 4, "expected '0,1,2' or 'cpu:N'"),
        ("0,,1", 4, "expected '0,1,2' or 'cpu:N'"),
        ("cpu:x", 0, "expected '0,1,2' or 'cpu:N'"),
        ("1.5", 4, "expected '0,1,2' or 'cpu:N'"),
    ],
)
def test_parse_devices_rejects(spec, gpus, message):
    """A bad --megatron-devices is an error that quotes the option, never a silent fallback."""
    with pytest.raises(ValueError, match="--megatron-devices") as excinfo:
        parse_devices(spec, gpus, 2)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    ("devices", "size", "slot", "expected"),
    [
        (CPU8, 1, 0, (0,)),
        (CPU8, 1, 7, (7,)),
        (CPU8, 2, 0, (0, 1)),
        (CPU8, 2, 1, (2, 3)),
        (CPU8, 2, 3, (6, 7)),
        (CPU8, 4, 1, (4, 5, 6, 7)),
        (CPU8, 8, 0, tuple(range(8))),
        (CPU8, 3, 1, (3, 4, 5)),
        (DeviceSet("cuda", (1, 3, 5, 6)), 2, 1, (5, 6)),
        (CPU8, 2, 4, None),
        (CPU8, 3, 2, None),
        (CPU8, 9, 0, None),
        (CPU8, 0, 0, None),
        (DeviceSet("cuda", ()), 1, 0, None),
    ],
)
def test_block_for(devices, size, slot, expected):
    """Blocks are aligned to their size ([slot*k, (slot+1)*k)); one that does not fit is None."""
    assert block_for(devices, size, slot) == expected


@pytest.mark.parametrize(
    ("devices", "block", "expected"),
    [
        (CPU8, (2, 3), ""),
        (DeviceSet("cuda", (0, 1, 2, 3)), (2, 3), "2,3"),
        (DeviceSet("cuda", (0, 1, 2, 3), ("4", "5", "6", "7")), (2, 3), "6,7"),
        (DeviceSet("cuda", (0, 1), ("GPU-a", "GPU-b")), (1,), "GPU-b"),
        (parse_devices("1,3", 4, 2, "10,11,12,13"), (1, 3), "11,13"),
    ],
)
def test_visible_devices(devices, block, expected):
    """Ranks see their block by the ids the session saw (CUDA_VISIBLE_DEVICES), none on CPU."""
    assert devices.visible_devices(block) == expected


def test_device_set_counts():
    """count and is_cuda drive skipping ('needs N devices, M available') and the backend."""
    assert (CPU8.count, CPU8.is_cuda) == (8, False)
    gpus = parse_devices("0,2", 4, 2)
    assert (gpus.count, gpus.is_cuda) == (2, True)


@pytest.mark.parametrize(
    ("worker", "size", "workers", "slot"),
    [
        (1, 4, 8, 0),  # 8 workers on 8 devices: the block of the home device
        (5, 4, 8, 1),
        (3, 2, 8, 1),
        (6, 1, 8, 6),
        (1, 4, 2, 1),  # 2 workers on 8 devices: spread evenly
        (1, 2, 2, 2),
        (1, 1, 2, 4),
        (2, 1, 3, 5),  # 3 workers: 0, 2, 5
        (9, 2, 16, 0),  # 2 gangs per device: worker 9's home device is 1
        (7, 3, 8, 1),  # a size that does not divide the devices: the last block that fits
        (0, 16, 8, None),
    ],
)
def test_gang_slot_for_a_known_worker_count(worker, size, workers, slot):
    """With the worker count known, a worker's blocks follow its place among the workers."""
    assert gang_slot(worker, size, 8, workers) == slot


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 8, 16])
def test_a_workers_blocks_nest(workers):
    """Each of a worker's blocks lies inside its larger ones (sizes 1, 2, 4, 8 on 8 devices), so
    after a large gang a worker goes on with smaller ones on devices it already had."""
    devices = shared_by(CPU8, workers)
    for worker in range(workers):
        blocks = [set(worker_block(devices, worker, size)) for size in (1, 2, 4, 8)]
        assert all(small <= large for small, large in zip(blocks, blocks[1:], strict=False))


def test_the_worker_count_travels_to_the_workers():
    """The controller hands the devices to its workers as plain data, worker count included."""
    devices = shared_by(parse_devices("0,2", 4, 2), 2)
    assert from_dict(to_dict(devices)) == devices
    assert from_dict({"kind": "cpu", "ids": [0, 1], "physical": []}).workers == 0
