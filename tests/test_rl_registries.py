"""The names the config accepts are the names rl/ implements, and a new implementation is one decorator away.

``AlgorithmSettings`` builds each name's ``Literal`` from its registry (``rl/advantages.py``, ``rl/filters.py``,
``rl/loss_terms.py``, none of which imports torch); these tests tie the two together, check the lookup and its
error, and run docs/rl.md's "Adding an advantage estimator" example as written.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.rl import (
    ADVANTAGE_ESTIMATORS,
    FILTER_METHODS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    compute_advantages,
    filter_samples,
    kl_penalty,
    loss_denominator,
    masked_aggregate,
    policy_loss,
)

ROOT = Path(__file__).resolve().parents[1]
REGISTRIES = {
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "filter_method": FILTER_METHODS,
    "kl_estimator": KL_ESTIMATORS,
    "loss_agg_mode": LOSS_AGG_MODES,
    "policy_loss": POLICY_LOSSES,
}


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_the_config_literal_lists_exactly_the_registered_names(key: str) -> None:
    allowed = get_args(AlgorithmSettings.model_fields[key].annotation)
    registry = REGISTRIES[key]
    assert allowed, f"AlgorithmSettings.{key} is no longer a Literal"
    assert len(set(allowed)) == len(allowed), f"AlgorithmSettings.{key} repeats a name: {allowed}"
    assert set(allowed) == set(registry.names()), (
        f"AlgorithmSettings.{key} allows {sorted(allowed)} but rl/ registers {sorted(registry.names())}: "
        "configs/settings.py must build the Literal from the registry"
    )
    assert registry.config_key == f"algorithm.{key}"


def test_the_default_of_each_setting_is_registered() -> None:
    defaults = AlgorithmSettings()
    for key, registry in REGISTRIES.items():
        registry.get(getattr(defaults, key))


@pytest.fixture
def toy_estimator():
    @ADVANTAGE_ESTIMATORS.register("toy_max")
    def toy(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
        adv = np.full_like(rewards, 7.0)  # also on uniform groups: compute_advantages must zero them
        for idx in groups:
            adv[idx] = rewards[idx] - rewards[idx].max()
        return adv

    try:
        yield toy
    finally:
        ADVANTAGE_ESTIMATORS.unregister("toy_max")
    assert "toy_max" not in ADVANTAGE_ESTIMATORS


def test_a_registered_toy_estimator_is_found_by_name(toy_estimator) -> None:
    assert ADVANTAGE_ESTIMATORS.get("toy_max") is toy_estimator
    assert "toy_max" in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.names()[-1] == "toy_max"
    adv = compute_advantages([1.0, 3.0, 2.0, 2.0, 5.0], ["a", "a", "b", "b", "c"], "toy_max")
    np.testing.assert_array_equal(adv, [-2.0, 0.0, 0.0, 0.0, 0.0])  # b (equal rewards) and c (alone) get 0
    assert adv.dtype == np.float64


def test_an_estimator_of_the_wrong_shape_is_refused() -> None:
    @ADVANTAGE_ESTIMATORS.register("toy_short")
    def short(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
        return rewards[:-1]

    try:
        with pytest.raises(ValueError, match=r"'toy_short' returned shape \(1,\), expected \(2,\)"):
            compute_advantages([0.0, 1.0], ["a", "a"], "toy_short")
    finally:
        ADVANTAGE_ESTIMATORS.unregister("toy_short")


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda rewards, groups, eps: rewards)
    assert ADVANTAGE_ESTIMATORS.names() == ("grpo", "grpo_no_std", "rloo", "reinforce_pp")
    with pytest.raises(ValueError, match="non-empty str"):
        Registry("thing", "algorithm.thing").register("")


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_an_unknown_name_says_what_is_known_and_which_key_to_set(key: str) -> None:
    registry = REGISTRIES[key]
    with pytest.raises(ValueError) as err:
        registry.get("no-such-name")
    text = str(err.value)
    assert f"unknown {registry.kind} 'no-such-name'" in text
    assert all(repr(name) in text for name in registry.names()), text
    assert f"set algorithm.{key} to one of them" in text
    assert "no-such-name" not in registry and len(registry) == len(registry.names()) == len(list(registry))


def test_the_public_functions_raise_the_registry_error() -> None:
    mask = torch.ones(1, 2)
    calls = {
        "algorithm.advantage_estimator": lambda: compute_advantages([0.0, 1.0], ["a", "a"], "gae"),
        "algorithm.filter_method": lambda: filter_samples(["a"], [0.0], "median", 0.0),
        "algorithm.kl_estimator": lambda: kl_penalty(torch.zeros(2), torch.zeros(2), "k4"),
        "algorithm.loss_agg_mode": lambda: masked_aggregate(torch.zeros(1, 2), mask, "sum"),
        "algorithm.policy_loss": lambda: policy_loss(*[torch.zeros(1, 2)] * 3, mask, 0.2, 0.2, policy_loss_name="gspo"),
    }
    for config_key, call in calls.items():
        with pytest.raises(ValueError, match=f"set {re.escape(config_key)} to one of them"):
            call()
    with pytest.raises(ValueError, match=r"set algorithm\.loss_agg_mode to one of them"):
        loss_denominator([1, 2], "sum")


def test_registry_get_refuses_unhashable_names_with_the_same_error() -> None:
    with pytest.raises(ValueError, match="unknown kl_estimator"):
        KL_ESTIMATORS.get(["k3"])  # type: ignore[arg-type]
    assert ["k3"] not in KL_ESTIMATORS


def _docs_section() -> str:
    text = (ROOT / "docs" / "rl.md").read_text()
    start = text.index("### Adding an advantage estimator")
    end = text.find("\n#", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_docs_example_is_the_whole_change() -> None:
    """docs/rl.md's two code blocks, the decorated estimator and its test, are the whole change: the test passes,
    and a config selects the new name with nothing else edited (in a fresh process where the estimator is
    registered before the config is imported, as it is when it sits in rl/advantages.py)."""
    blocks = re.findall(r"```python\n(.*?)```", _docs_section(), flags=re.DOTALL)
    assert len(blocks) == 2, blocks
    estimator, test_code = blocks
    fresh = "\n".join(
        [
            "import numpy as np",
            "from pettingflow.rl.advantages import ADVANTAGE_ESTIMATORS",
            estimator,
            "from pettingflow.configs import load_config",
            "cfg = load_config('code-env', ['algorithm.advantage_estimator=sign'])",
            "assert cfg.algorithm.advantage_estimator == 'sign', cfg.algorithm",
        ]
    )
    done = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    namespace = {"np": np, "ADVANTAGE_ESTIMATORS": ADVANTAGE_ESTIMATORS, "compute_advantages": compute_advantages}
    exec(compile(estimator, "docs/rl.md", "exec"), namespace)  # the docs' own example
    try:
        assert "sign" in ADVANTAGE_ESTIMATORS
        exec(compile(test_code, "docs/rl.md", "exec"), namespace)
        tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
        assert len(tests) == 1
        tests[0]()
    finally:
        ADVANTAGE_ESTIMATORS.unregister("sign")
