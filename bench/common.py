"""Shared helpers of the benchmarks: environment, timing, medians, tables, servers, temp dirs, waiting for load.

Every bench sets ``OMP_NUM_THREADS=1`` and the offline flags *before* torch is imported (import this module
first). Benchmarks report ratios measured side by side in one run (alternating rounds, medians); absolute
numbers depend on whatever else runs on the machine and are never asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two computing processes must not oversubscribe the cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import contextlib
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m-instruct"


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "transformers", "httpcore", "prefect", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` (perf_counter seconds)."""

    def __enter__(self) -> Timer:
        self.started = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.started


def alternate(round_idx: int, first: Any, second: Any) -> list[Any]:
    """The two arms of a round in alternating order: ``first`` leads in even rounds, ``second`` in odd ones."""
    return [first, second] if round_idx % 2 == 0 else [second, first]


def rotate(round_idx: int, *arms: Any) -> list[Any]:
    """Three or more arms in an order that moves by one each round, so each leads as often as the others."""
    k = round_idx % len(arms)
    return [*arms[k:], *arms[:k]]


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    """A plain fixed-width table; the first column left-aligned, the others right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))
    print()
    if title:
        print(title)
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    print("-" * len(line))


def ratio_line(name: str, ratios: Sequence[float], goal: float, higher_is_better: bool = True) -> str:
    med = median(ratios)
    ok = med >= goal if higher_is_better else med <= goal
    sign = ">=" if higher_is_better else "<="
    rounds = ", ".join(f"{r:.3f}" for r in ratios)
    return f"{name}: median {med:.3f} (rounds: {rounds}); goal {sign} {goal}: {'OK' if ok else 'BELOW GOAL'}"


def wait_for_quiet(poll_s: float = 60.0, max_wait_s: float = 3600.0, pattern: str = "pytest") -> None:
    """Wait while another heavy run (default: a pytest session) is going, so that it does not skew the numbers."""
    waited = 0.0
    while waited < max_wait_s:
        busy = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        busy = [p for p in busy if int(p) != os.getpid()]
        if not busy:
            return
        print(f"waiting: {len(busy)} '{pattern}' process(es) running ({waited:.0f} s so far)", flush=True)
        time.sleep(poll_s)
        waited += poll_s
    print(f"still busy after {max_wait_s:.0f} s: measuring anyway (numbers may be skewed)", flush=True)


def add_common_args(parser: Any) -> None:
    parser.add_argument("--no-wait", action="store_true", help="do not wait for running pytest sessions to finish")


def parse_args(parser: Any, argv: list[str] | None, wait: bool = True) -> Any:
    """Parse the bench's arguments (plus the common ones), set up logging, and by default wait until no
    test session is running, so the two arms of a bench are not measured on a loaded machine."""
    add_common_args(parser)
    args = parser.parse_args(argv)
    setup_logging()
    if wait and not args.no_wait:
        wait_for_quiet()
    return args


def temp_prefect_state(prefix: str) -> Path:
    """A temp folder (removed at exit) for Prefect's database and PettingFlow's state, exported via env."""
    import atexit

    state = Path(tempfile.mkdtemp(prefix=f"pettingflow-bench-{prefix}-"))
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    os.environ.setdefault("PETTINGFLOW_STATE", str(state / "state"))
    os.environ.setdefault("PREFECT_HOME", str(state / "prefect"))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(state / "prefect-results"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    return state


@contextlib.contextmanager
def temp_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"pettingflow-bench-{prefix}-"))
    try:
        yield path
    finally:
        if keep:
            print(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    from pettingflow.inference.models import prepare_model, resolve_model

    return prepare_model(name) if name == DEFAULT_MODEL else resolve_model(name)


@contextlib.contextmanager
def vllm_server(
    model: Path, served_name: str = DEFAULT_MODEL, url: str | None = None, kv_cache_gib: int = 2, **kwargs: Any
) -> Iterator[Any]:
    """A vLLM server for the bench: started here and stopped (by PID) afterwards, or attached to ``url``."""
    from pettingflow.inference.server import ExternalServer, VLLMServer

    if url:
        server: Any = ExternalServer(url, served_model_name=served_name).start()
    else:
        server = VLLMServer(model, served_model_name=served_name, kv_cache_gib=kv_cache_gib, **kwargs)
        server.start()
        print(f"vLLM started in {server.startup_seconds:.0f} s (pid {server.pid}, log {server.log_path})", flush=True)
    try:
        yield server
    finally:
        server.stop()


def code_env_config(model: Path, *overrides: str) -> Any:
    """The shipped ``code-env`` config on the given model, in-process sandbox (no Ray)."""
    from pettingflow.configs import load_config

    return load_config("code-env", [f"policies.0.model={model}", "rollout.use_ray=false", *overrides])


def rollout_endpoints(config: Any, server: Any, served_name: str, model: Path) -> dict[str, Any]:
    from pettingflow.runs.endpoint import PolicyEndpoint

    return {
        p.name: PolicyEndpoint(policy=p.name, url=server.url, served_model=served_name, model_dir=str(model))
        for p in config.policies
    }


def run_rollouts(config: Any, endpoints: dict[str, Any], tasks: list[dict[str, Any]], group_size: int, ns: str, cache):
    """One engine round; returns (records, stats, wall seconds measured around ``run_episodes``)."""
    import asyncio

    from pettingflow.rollout.local import run_episodes

    with Timer() as t:
        records, stats = asyncio.run(
            run_episodes(
                config, endpoints, tasks, group_size=group_size, seed_namespace=ns, env_cache=cache, show_progress=False
            )
        )
    return records, stats, t.s


def python() -> str:
    return sys.executable


def serve(argv: list[str] | None = None) -> int:
    """``python -m bench.common [--kv-cache-gib N]``: start one vLLM server (dev mode) for the ``--url`` flags.

    Prints the URL, then waits; SIGINT or SIGTERM stops the server (its whole process group) and exits.
    """
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m bench.common", description=serve.__doc__)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    args = parser.parse_args(argv)
    setup_logging()
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with vllm_server(model_dir(), DEFAULT_MODEL, kv_cache_gib=args.kv_cache_gib, dev_mode=True) as server:
        print(f"URL {server.url}", flush=True)
        while not stop["now"]:
            time.sleep(1)
    return 0


def request_body(model: str, prompt: list[int], new_tokens: int, seed: int) -> dict[str, Any]:
    """The raw ``/v1/completions`` body the benches send: exactly what ``InferenceClient.complete()`` sends
    for these arguments (temperature 1, ``ignore_eos``), so raw and client/engine arms do the same work."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "n": 1,
        "logprobs": 1,
        "return_token_ids": True,
        "seed": seed,
        "ignore_eos": True,
    }


def random_llama_config(shape: dict[str, int]) -> Any:
    """The ``LlamaConfig`` of the random models the learner benches build locally (nothing downloaded): tied
    embeddings as SmolLM2; ``shape`` has vocab, hidden, intermediate, layers, heads and optionally kv_heads."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape.get("kv_heads", shape["heads"]),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def write_random_batch(
    path: Path,
    rows: int,
    seq_len: int,
    prompt_len: int,
    vocab: int,
    *,
    seed: int = 0,
    group_size: int = 1,
    sampler_logprob: float = -10.0,
    run_id: str = "bench",
    shared_prompts: bool = False,
) -> int:
    """A batch Parquet for policy ``shared``: ``rows`` rows of random tokens (``prompt_len`` prompt, the rest a
    fully trained response), groups of ``group_size`` rows, advantages +1/-1, one ``sampler_logprob`` per token;
    with ``shared_prompts`` the rows of a group share one prompt, as a GRPO group's samples do. Returns the number
    of trained (mask-1) tokens."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pettingflow.storage.schema import trajectories_to_table

    rng = random.Random(seed)
    resp = seq_len - prompt_len
    out = []
    prompts: dict[int, list[int]] = {}
    for i in range(rows):
        group = i // group_size
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        if shared_prompts:
            prompt = prompts.setdefault(group, prompt)
        out.append(
            {
                "run_id": run_id,
                "iteration": 0,
                "env_name": "code-env",
                "env_idx": group,
                "group_id": f"g{group}",
                "sample_idx": i,
                "rollout_idx": i,
                "turn_idx": 0,
                "agent_idx": 0,
                "agent_name": "code_generator",
                "policy_name": "shared",
                "lora_name": None,
                "prompt_ids": prompt,
                "response_ids": [rng.randrange(3, vocab) for _ in range(resp)],
                "response_mask": [1] * resp,
                "sampler_logprobs": [sampler_logprob] * resp,
                "reward": float(i % 2),
                "final_reward": float(i % 2),
                "success": bool(i % 2),
                "done": True,
                "truncated": False,
                "uid": f"u{group}",
                "prompt_text": "p",
                "response_text": "r",
                "info_json": "{}",
                "policy_version": 0,
                "branch_idx": 0,
                "continued": True,
            }
        )
    table = trajectories_to_table(out)
    table = table.append_column("advantage", pa.array([1.0 if i % 2 else -1.0 for i in range(rows)], pa.float32()))
    pq.write_table(table, path)
    return rows * resp


if __name__ == "__main__":
    sys.exit(serve())


TRL_VERSION = "1.16.0"  # the TRL the comparisons with it (bench/iteration_vs_trl.py, bench/learning_vs_trl.py) target


def trl_import_error() -> str | None:
    try:
        import trl
    except Exception as exc:
        return f"TRL cannot be imported ({type(exc).__name__}: {exc}); install it with pip install trl=={TRL_VERSION}"
    if trl.__version__ != TRL_VERSION:
        return f"trl {trl.__version__} installed, the bench targets {TRL_VERSION}"
    return None
