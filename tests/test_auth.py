"""Keys of servers beyond loopback (``inference/auth.py``, ``configs/addresses.py``) and the config's refusal of
dev mode there."""

from __future__ import annotations

import pytest

from pettingflow.configs import ConfigError, load_config
from pettingflow.configs.addresses import is_loopback
from pettingflow.inference import auth
from pettingflow.inference.client import InferenceClient


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost", ""):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.0.2.7"):  # (no name lookups: they would leave the machine)
        assert not is_loopback(host), host


def test_a_registered_key_goes_with_every_request_to_that_server_only() -> None:
    key = auth.new_key()
    assert len(key) >= 40 and key != auth.new_key()
    auth.register("http://10.0.0.5:8000/v1", key)
    try:
        assert auth.headers("http://10.0.0.5:8000") == {"Authorization": f"Bearer {key}"}
        assert auth.headers("http://10.0.0.5:8000/v1/completions") == auth.headers("http://10.0.0.5:8000/")
        assert auth.headers("http://10.0.0.5:8001") == {}
        assert InferenceClient("http://10.0.0.5:8000/v1")._headers == {"Authorization": f"Bearer {key}"}
        assert InferenceClient("http://10.0.0.5:8000", api_key="other")._headers["Authorization"] == "Bearer other"
    finally:
        auth.register("http://10.0.0.5:8000", None)
    assert auth.headers("http://10.0.0.5:8000") == {}


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [
        (["inference.host=0.0.0.0"], False),  # full weights reloaded through dev mode: its routes have no key
        (["inference.host=0.0.0.0", "inference.between_updates=sleep"], False),
        (["inference.host=0.0.0.0", "inference.between_updates=restart", "inference.weight_sync=gloo"], False),
        (["inference.host=0.0.0.0", "inference.between_updates=restart"], True),  # a restart loads the new folder
        (["inference.host=0.0.0.0", "specialization=lora", "policies.0.lora.rank=8"], True),  # adapters via /v1
        (["inference.host=127.0.0.1"], True),
        (["inference.host=0.0.0.0", "inference.url=http://10.0.0.5:8000"], True),  # attached: not started here
    ],
)
def test_dev_mode_is_refused_beyond_loopback(overrides: list[str], allowed: bool) -> None:
    if allowed:
        load_config("code-env", overrides)
        return
    with pytest.raises(ConfigError) as info:
        load_config("code-env", overrides)
    (path, why), *_ = info.value.problems
    assert path == "inference.host" and "dev-mode routes" in why and "\n" not in why


def test_a_server_listening_on_a_wildcard_is_reached_at_this_machines_address(tmp_path, monkeypatch) -> None:
    """``inference.host: 0.0.0.0`` is where a replica listens; its URL (what Ray rollout workers on other nodes
    dial, what the key registry and the rows record) must be an address, never the wildcard itself."""
    from pettingflow.inference.server import VLLMServer, reachable_host

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv("PETTINGFLOW_NODE_IP", raising=False)
    url = VLLMServer(tmp_path, device="cpu", host="0.0.0.0", port=8000).url
    assert "0.0.0.0" not in url and url.endswith(":8000")
    monkeypatch.setenv("PETTINGFLOW_NODE_IP", "10.1.2.3")
    assert VLLMServer(tmp_path, device="cpu", host="0.0.0.0", port=8000).url == "http://10.1.2.3:8000"
    assert VLLMServer(tmp_path, device="cpu", host="127.0.0.1", port=8000).url == "http://127.0.0.1:8000"
    assert reachable_host("::1") == "[::1]" and reachable_host("10.0.0.7") == "10.0.0.7"
