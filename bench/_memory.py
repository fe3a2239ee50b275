"""Peak memory of a process tree while it runs: host PSS and, where nvidia-smi exists, GPU memory.

PSS (proportional set size) splits each shared page among the processes that map it, so ranks
forked from one zygote are not counted once per rank for the pages they share. Linux /proc only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

INTERVAL = 1.0  # seconds between samples


class PeakMemory:
    """Samples the tree under `root_pid` (zygotes in their own sessions included) until stopped."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.host_peak = 0  # bytes
        self.gpu_peak: int | None = 0 if shutil.which("nvidia-smi") else None  # bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(INTERVAL):
            self.host_peak = max(self.host_peak, sum(map(pss, descendants(self.root_pid))))
            if self.gpu_peak is not None:
                self.gpu_peak = max(self.gpu_peak, gpu_memory_used())


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def pss(pid: int) -> int:
    """Bytes of the process's proportional set size (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def gpu_memory_used() -> int:
    """Bytes of memory in use on every visible GPU together, as nvidia-smi reports it."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        return sum(int(line) for line in out.split()) * 2**20
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0
