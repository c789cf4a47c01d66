"""What a run uses: peak memory per process, the model's FLOPs per example, and the device's peak FLOP/s."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import default_collate

__all__ = ["peak_memory", "set_baseline", "outside_peak", "rank_memory", "memory_text", "flops_per_example",
           "flops_per_length", "peak_tflops", "PEAK_TFLOPS", "process_age", "slow_bf16_hint"]

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (name fragment, bf16/fp16 tensor cores, fp32).
# The first fragment found in torch.cuda.get_device_name() wins, so the more specific ones come first.
PEAK_TFLOPS: tuple[tuple[str, float | None, float], ...] = (
    ("H100 PCIe", 756.0, 51.0), ("H100 NVL", 835.0, 60.0), ("H100", 989.0, 67.0), ("H200", 989.0, 67.0),
    ("GH200", 989.0, 67.0), ("A100", 312.0, 19.5), ("L40S", 362.0, 91.6), ("L4", 121.0, 30.3),
    ("V100", None, 15.7),
)


_BASELINE: list[float] = []   # the process's resident set (MiB) before its model was built (set_baseline)
_BEFORE: list[float] = [0.0]   # the peak (MiB) before a probe that is not the run's own (outside_peak)


def set_baseline(nbytes: float) -> None:
    """The resident set before the model is built: CPU peaks are also given above it (``above_baseline``). On Linux
    the process's resident high-water mark starts again here (``/proc/self/clear_refs``), so a process that ran
    something bigger before (a notebook, a test session) reports this run's peak, not its own past one."""
    _BASELINE[:] = [nbytes / 2**20]
    _BEFORE[0] = 0.0
    _reset_peak()   # (not Linux, or not allowed: the peak is the process's)


def _reset_peak() -> bool:
    """Start the process's resident high-water mark again (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _max_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


@contextlib.contextmanager
def outside_peak(trim: Callable[[], Any]) -> Iterator[bool]:
    """Memory used inside is not the run's (a start-up probe's): on Linux the peak so far is kept aside, and after
    ``trim`` (giving the freed memory back) the high-water mark starts again. Yields whether it can (else the
    caller keeps its probe small)."""
    before = _max_rss()
    can = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")
    try:
        yield can
    finally:
        if can:
            trim()
            if _reset_peak():
                _BEFORE[0] = max(_BEFORE[0], before)


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory in MiB: allocated and reserved by torch on CUDA, resident set (RSS) on CPU, and
    above the baseline (:func:`set_baseline`) once it is known."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device) / 2**20,
                "reserved": torch.cuda.max_memory_reserved(device) / 2**20}
    peak = max(_max_rss(), _BEFORE[0])
    return {"rss": peak, **({"above_baseline": max(0.0, peak - _BASELINE[0])} if _BASELINE else {})}


def rank_memory(device: torch.device) -> float:
    """Bytes one rank may use here: its GPU's memory, or on CPU the host's memory shared by the node's ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(1, local)


def memory_text(mem: dict[str, float]) -> str:
    """``412 MiB RSS`` or ``10.2/12.0 GiB allocated/reserved``."""
    def size(mib: float) -> str:
        return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"
    if "rss" in mem:
        return f"{size(mem['rss'])} RSS"
    return f"{size(mem['allocated'])} allocated, {size(mem['reserved'])} reserved"


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_meta(t) for t in x)
    return x


def flops_per_example(factories: Sequence[Callable[[], torch.nn.Module]], inputs: Any) -> float | None:
    """Model FLOPs of training on one example: 3 x the forward's (the backward takes two matmuls per forward
    one), counted by torch.utils.flop_counter on the whole layer list built on the meta device (no memory, no
    compute; the global RNG is left as it was). Recompute is not counted: this is the model's work, not the
    engine's. ``inputs``: one example's inputs. None when a layer cannot run on the meta device (the count is
    a report, never a reason to stop)."""
    x = _meta(default_collate([inputs, inputs]))   # two: a batch of one is refused by BatchNorm in training
    try:
        from torch.utils.flop_counter import FlopCounterMode   # (it imports triton: not at a rank's start)
        with torch.random.fork_rng(devices=[]), torch.device("meta"), FlopCounterMode(display=False) as counter:
            for make in factories:
                x = make()(x)
    except Exception:   # noqa: BLE001 - whatever a user's layer raises on meta tensors
        return None
    total = counter.get_total_flops()
    return 3.0 * total / 2 if total else None


def flops_per_length(factories: Sequence[Callable[[], torch.nn.Module]], context: int) -> tuple[float, float] | None:
    """Model FLOPs of training on one sequence of n tokens as ``a n + b n²`` (the layers and the attention), fitted
    on :func:`flops_per_example` at n = ``context`` and half of it, one sequence of plain tokens (a padded row, or
    one of a microbatch's documents). A step's model FLOPs are then its real sequences' sum: the padding
    and the attention across documents a packed row masks off are not the model's work. None: not countable."""
    n1, n2 = context, max(1, context // 2)
    f1 = flops_per_example(factories, torch.zeros(n1, dtype=torch.int64))
    f2 = f1 if n1 == n2 else flops_per_example(factories, torch.zeros(n2, dtype=torch.int64))
    if f1 is None or f2 is None:
        return None
    b = 0.0 if n1 == n2 else max(0.0, (f1 / n1 - f2 / n2) / (n1 - n2))
    return f1 / n1 - b * n1, b


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak TFLOP/s for ``precision`` from :data:`PEAK_TFLOPS`; None on CPU or when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half, single in PEAK_TFLOPS:
        if fragment in name:
            return single if precision == "fp32" else half
    return None


_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere: since this module was imported)."""
    try:
        with open("/proc/self/stat") as fh:
            started = int(fh.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as fh:
            return max(0.0, float(fh.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def slow_bf16_hint(device: torch.device, precision: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """One line when bf16 runs on a CPU whose flags show no bf16 instructions (avx512_bf16 or amx_bf16 on
    x86, bf16 on Arm): there torch emulates bf16 and a step takes several times as long as in fp32."""
    if device.type != "cpu" or precision != "bf16":
        return None
    try:
        with open(cpuinfo) as fh:
            flags = {f for line in fh if line.lower().startswith(("flags", "features")) for f in line.split()}
    except OSError:
        return None   # not Linux: nothing to say
    if not flags or flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return None
    return ("note: this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or bf16 in /proc/cpuinfo): "
            "--precision bf16 is emulated and slower than fp32 here; use --precision fp32 on this machine")
