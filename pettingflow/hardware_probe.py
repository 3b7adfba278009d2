"""Measure this machine's peaks once: matrix-multiply FLOP/s and memory bandwidth (``pettingflow hardware probe``).

Why measured, not looked up: a VM's vendor sheet says little about what torch reaches on it (which ISA its
kernels use, how many cores the VM really has, what a neighbour is doing), and the roofline's fractions are only
as honest as their peak. The result is cached per machine (CPU model, core count, torch version, threads) in
``$PETTINGFLOW_HOME/hardware/``; iteration reports use a cached probe and never probe during a run, where it
would compete with the run itself.

Measured: FLOP/s of ``torch.matmul`` at a large square shape and at each multiply of the default model's forward
(``roofline.ModelShape.matmul_shapes``), in bf16 and fp32, the fastest of a few timed repeats after a warm-up; memory
bandwidth as a large tensor copy (bytes read + written per second).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from pettingflow.hardware import cpu_model
from pettingflow.paths import home
from pettingflow.roofline import ModelShape

PROBE_VERSION = 1
DEFAULT_TOKENS = 512  # rows of the model-shape multiplies: a micro-batch's worth of tokens
LARGE = 2048


def machine_key(threads: int) -> str:
    """What a probe is valid for: the CPU model, the cores, torch's version and the threads it used."""
    import torch

    cpu = cpu_model()
    if cpu == "unknown CPU":
        cpu = platform.processor() or ""
    text = f"{cpu}|{os.cpu_count()}|{torch.__version__}|{threads}|v{PROBE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(threads: int) -> Path:
    return home() / "hardware" / f"probe-{machine_key(threads)}.json"


def _time(fn, repeats: int, device: str) -> float:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()  # warm-up: kernels picked, memory touched
    sync()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    # the fastest repeat: a peak is what the machine can do, and interference only ever slows a repeat down
    return min(samples)


def matmul_flops(m: int, k: int, n: int, dtype: Any, repeats: int = 5, device: str = "cpu") -> float:
    import torch

    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    seconds = _time(lambda: torch.matmul(a, b), repeats, device)
    return 2.0 * m * k * n / seconds


def copy_bandwidth(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second of a large tensor copy, counting the read and the write."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), repeats, device)
    return 2.0 * n * 4 / seconds


def probe(shape: ModelShape, threads: int | None = None, tokens: int = DEFAULT_TOKENS, progress=print) -> dict:
    """Measure the peaks with ``threads`` torch threads (default: every core this process may use)."""
    import torch

    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the update runs
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "version": PROBE_VERSION,
        "machine": machine_key(threads),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokens": tokens,
        "matmul_flops": {},
    }
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        rates = {"large": matmul_flops(LARGE, LARGE, LARGE, dtype, device=device)}
        progress(f"{name} matmul {LARGE}^3: {rates['large'] / 1e12:.2f} TFLOP/s")
        for label, (m, k, n) in shape.matmul_shapes(tokens).items():
            rates[label] = matmul_flops(m, k, n, dtype, device=device)
            progress(f"{name} matmul {label} {m}x{k}x{n}: {rates[label] / 1e12:.2f} TFLOP/s")
        result["matmul_flops"][name] = rates
    result["bandwidth"] = copy_bandwidth(device=device)
    progress(f"memory bandwidth (copy): {result['bandwidth'] / 1e9:.1f} GB/s")
    return result


def save(result: dict) -> Path:
    path = cache_path(result["threads"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)
    return path


def load(threads: int | None = None) -> dict | None:
    """The cached probe of this machine at ``threads`` (default: every allowed core), or None."""
    threads = threads or len(os.sched_getaffinity(0))
    path = cache_path(threads)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
