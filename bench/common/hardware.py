"""Notes on the machine and the software a result was measured on, as the results
record them: the CPU, the device, threads, load, peak memory, the commit.

Light at import (torch only inside the functions that need it): the scale
benchmarks' child processes measure their own memory.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_note() -> str:
    """``<cpu>, <n> cores``."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def threads() -> str:
    """``<n> threads``: torch's intra-op threads."""
    import torch

    return f"{torch.get_num_threads()} threads"


def device_name(device: Any) -> str | None:
    """A CUDA device's name (the current one for a bare ``"cuda"``); None for others."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def peak_rss_gib() -> float:
    """The process's peak resident set (``VmHWM``), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def load_averages() -> str:
    """The 1-, 5- and 15-minute load averages as ``/proc/loadavg`` writes them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def commit(repo: Path) -> str:
    """The short hash of ``repo``'s checked-out commit (empty outside git)."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=repo, check=False)  # fmt: skip
    return proc.stdout.strip()
