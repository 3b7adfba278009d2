"""Env base, registry, env cache, mixed-env batches, HumanEval loading and the split."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pettingflow.configs.settings import DatasetSettings, EnvSettings
from pettingflow.envs.base import Env, EnvConfig, EnvConfigError
from pettingflow.envs.code_env import CodeEnv
from pettingflow.envs.humaneval import (
    REQUIRED_COLUMNS,
    TaskFileError,
    humaneval_path,
    load_humaneval,
    load_task_file,
    load_tasks,
    split_tasks,
)
from pettingflow.envs.registry import (
    EnvCache,
    EnvFactory,
    EnvSpec,
    RegistryError,
    TaskSpec,
    env_spec_from_settings,
    register_env,
    registered_envs,
    resolve_env_class,
    task_specs_from_rows,
)


class CounterConfig(EnvConfig):
    target: int = 2


class CounterEnv(Env):
    """A tiny env: solved when ``state`` reaches ``target``; counts shared-resource builds."""

    Config = CounterConfig
    builds: ClassVar[int] = 0

    def __init__(self, task: Any, config: Any = None, *, token: object = None, **kw: Any) -> None:
        self.token = token
        super().__init__(task, config, **kw)

    @classmethod
    def shared_resources(cls, config: EnvConfig) -> dict[str, Any]:
        CounterEnv.builds += 1
        return {"token": object()}

    def initial_state(self) -> int:
        return 0

    def solved(self) -> bool:
        return self.state >= self.config.target


COUNTER_PATH = f"{__name__}:CounterEnv"


# --------------------------------------------------------------------------------------------------
# Env base
# --------------------------------------------------------------------------------------------------
def test_env_fields_and_reset() -> None:
    env = CounterEnv({"task_id": "t"}, {"max_turns": 3}, env_idx=2, rollout_idx=1, seed=5)
    assert (env.env_idx, env.rollout_idx, env.max_turns, env.current_turn, env.seed) == (2, 1, 3, 0, 5)
    assert env.state == 0 and not env.done and env.history == [] and env.task == {"task_id": "t"}
    env.finish_turn({"agent_name": "a"})
    assert env.history == [{"turn": 0, "agent_name": "a"}] and env.current_turn == 1
    env.reset(seed=9)
    assert env.current_turn == 0 and env.history == [] and env.seed == 9


def test_env_done_when_solved_before_max_turns() -> None:
    env = CounterEnv({}, {"max_turns": 5, "target": 1})
    env.state = 1
    env.finish_turn()
    assert env.done and not env.truncated


def test_env_truncated_at_max_turns() -> None:
    env = CounterEnv({}, {"max_turns": 2})
    env.finish_turn()
    assert not env.done
    env.finish_turn()
    assert env.done and env.truncated
    with pytest.raises(RuntimeError, match="already done"):
        env.finish_turn()


def test_env_config_errors_list_known_keys() -> None:
    with pytest.raises(EnvConfigError, match=r"max_turns: .*known keys: max_turns, target"):
        CounterEnv({}, {"max_turns": 0})
    with pytest.raises(EnvConfigError, match="bogus"):
        CounterEnv({}, {"bogus": 1})


def test_base_env_needs_initial_state() -> None:
    with pytest.raises(NotImplementedError, match="initial_state"):
        Env({})


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
def test_resolve_short_name_and_import_path() -> None:
    assert resolve_env_class("code-env") is CodeEnv
    assert resolve_env_class("pettingflow.envs.code_env:CodeEnv") is CodeEnv
    assert resolve_env_class(COUNTER_PATH) is CounterEnv
    assert "code-env" in registered_envs()


def test_resolve_errors_are_specific() -> None:
    with pytest.raises(RegistryError, match=r"unknown env 'nope'; registered names: .*code-env.*package.module:Class"):
        resolve_env_class("nope")
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module'"):
        resolve_env_class("no_such_module:X")
    with pytest.raises(RegistryError, match="has no attribute 'Missing'"):
        resolve_env_class("pettingflow.envs.code_env:Missing")
    with pytest.raises(RegistryError, match="not a subclass of Env"):
        resolve_env_class("pettingflow.envs.code_env:CodeEnvState")


def test_register_env_as_decorator_and_conflicts() -> None:
    register_env("test-counter", CounterEnv, replace=True)
    assert resolve_env_class("test-counter") is CounterEnv
    register_env("test-counter", COUNTER_PATH)  # same target: fine
    with pytest.raises(RegistryError, match="already registered"):
        register_env("test-counter", "pettingflow.envs.code_env:CodeEnv")

    @register_env("test-counter-2", replace=True)
    class Other(CounterEnv):
        pass

    assert resolve_env_class("test-counter-2") is Other


# --------------------------------------------------------------------------------------------------
# specs and the cache
# --------------------------------------------------------------------------------------------------
def test_spec_canonicalizes_name_and_defaults() -> None:
    a = EnvSpec.of("code-env", {})
    b = EnvSpec.of("pettingflow.envs.code_env:CodeEnv", {"max_turns": 4})
    assert a == b and hash(a) == hash(b)
    assert a.class_path == "pettingflow.envs.code_env:CodeEnv"
    assert a.config["max_turns"] == 4 and "sandbox" in a.config
    assert EnvSpec.of("code-env", {"max_turns": 3}) != a


def test_env_cache_reuses_factory_per_key() -> None:
    CounterEnv.builds = 0
    cache = EnvCache()
    f1 = cache.get(EnvSpec.of(COUNTER_PATH, {"target": 3}))
    f2 = cache.get(EnvSpec.of(COUNTER_PATH, {"target": 3}))
    f3 = cache.get(EnvSpec.of(COUNTER_PATH, {"target": 4}))
    assert f1 is f2 and f3 is not f1 and len(cache) == 2
    e1 = f1.create({"task_id": "a"}, env_idx=0, rollout_idx=0, seed=1)
    e2 = f1.create({"task_id": "b"}, env_idx=1, rollout_idx=1, seed=1)
    assert e1 is not e2 and e1.token is e2.token  # fresh episodes, one shared resource build
    assert e1.config.target == 3 and e2.env_idx == 1
    f3.create({})
    assert CounterEnv.builds == 2


def test_env_factory_accepts_injected_shared_resources() -> None:
    token = object()
    env = EnvFactory(EnvSpec.of(COUNTER_PATH), shared={"token": token}).create({})
    assert env.token is token


def test_env_spec_from_settings_passes_env_keys() -> None:
    spec = env_spec_from_settings(EnvSettings(max_turns=6))
    assert spec.class_path == "pettingflow.envs.code_env:CodeEnv"
    assert spec.config["max_turns"] == 6 and spec.config["sandbox"]["backend"] == "bubblewrap"


# --------------------------------------------------------------------------------------------------
# mixed-env batches
# --------------------------------------------------------------------------------------------------
def test_rows_become_task_specs_in_order() -> None:
    default = EnvSpec.of(COUNTER_PATH, {"target": 2})
    rows = [
        {"task_id": "bare-0"},
        {"env_class_path": COUNTER_PATH, "env_config": {"target": 5}, "task_data": {"task_id": "t5-1"}},
        {"task_data": {"task_id": "default-2"}},
        {"env_class_path": "code-env", "env_config": {"max_turns": 2}, "task_data": {"task_id": "code-3"}},
        {"env_class_path": COUNTER_PATH, "env_config": {"target": 5}, "task_data": {"task_id": "t5-4"}},
        {"env_class_path": COUNTER_PATH, "task_data": {"task_id": "default-5"}},
    ]
    specs = task_specs_from_rows(rows, default)
    assert [s.index for s in specs] == list(range(6))
    assert [s.task["task_id"] for s in specs] == [(r.get("task_data") or r)["task_id"] for r in rows]
    # a row without its own config on the default class shares the default spec
    assert specs[0].env == specs[2].env == specs[5].env == default
    assert specs[1].env == specs[4].env != default
    assert specs[3].env.class_path.endswith(":CodeEnv") and specs[3].env.config["max_turns"] == 2


def test_row_naming_env_without_task_data_is_an_error() -> None:
    with pytest.raises(ValueError, match="no 'task_data'"):
        TaskSpec.from_row({"env_class_path": "code-env"}, EnvSpec.of(COUNTER_PATH), 0)


# --------------------------------------------------------------------------------------------------
# HumanEval and task files
# --------------------------------------------------------------------------------------------------
def test_humaneval_loads_164_tasks_offline() -> None:
    tasks = load_humaneval()
    assert len(tasks) == 164
    assert humaneval_path().name == "HumanEval.jsonl.gz"
    assert all(set(REQUIRED_COLUMNS) <= set(t) for t in tasks)
    assert tasks[0]["task_id"] == "HumanEval/0" and tasks[0]["entry_point"] == "has_close_elements"


def test_split_is_deterministic_disjoint_and_exact() -> None:
    tasks = load_humaneval()
    a = split_tasks(tasks, 0.2, split_seed=0)
    b = split_tasks(list(reversed(tasks)), 0.2, split_seed=0)
    ids = lambda ts: {t["task_id"] for t in ts}  # noqa: E731
    assert ids(a.validation) == ids(b.validation)  # independent of input order
    assert len(a.validation) == round(164 * 0.2) == 33
    assert ids(a.train).isdisjoint(ids(a.validation))
    assert ids(a.train) | ids(a.validation) == ids(tasks)
    other = split_tasks(tasks, 0.2, split_seed=1)
    assert ids(other.validation) != ids(a.validation)
    assert len(split_tasks(tasks, 0.5, 0).validation) == 82


def test_split_pins_known_members() -> None:
    # guards against an accidental change of the hash recipe (which would reshuffle every run's split)
    val = [t["task_id"] for t in split_tasks(load_humaneval(), 0.2, 0).validation]
    assert val[:3] == PINNED_VALIDATION_HEAD


PINNED_VALIDATION_HEAD = ["HumanEval/2", "HumanEval/6", "HumanEval/14"]


def test_split_small_sets() -> None:
    two = [{"task_id": "a"}, {"task_id": "b"}]
    s = split_tasks(two, 0.01, 0)
    assert len(s.validation) == 1 and len(s.train) == 1
    assert split_tasks([{"task_id": "a"}], 0.5, 0).validation == []
    with pytest.raises(ValueError, match="validation_fraction"):
        split_tasks(two, 1.0, 0)


def _row(i: int) -> dict[str, str]:
    return {
        "task_id": f"T/{i}",
        "prompt": f"def f{i}(x):\n",
        "canonical_solution": "    return x\n",
        "test": "def check(candidate):\n    assert candidate(1) == 1\n",
        "entry_point": f"f{i}",
    }


def test_task_file_jsonl_gz_and_parquet(tmp_path: Path) -> None:
    rows = [_row(i) for i in range(3)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows))
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, gz, parquet):
        assert load_task_file(path) == rows
    split = load_tasks(DatasetSettings(source="file", path=str(parquet), validation_fraction=0.34))
    assert len(split.validation) == 1 and len(split.train) == 2


def test_task_file_errors_name_file_and_columns(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({k: v for k, v in _row(0).items() if k not in ("test", "entry_point")}) + "\n")
    with pytest.raises(TaskFileError, match=r"bad\.jsonl: row 0 is missing columns \['test', 'entry_point'\]"):
        load_task_file(bad)
    pbad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"task_id": "x", "prompt": "p"}]), pbad)
    with pytest.raises(TaskFileError, match=r"bad\.parquet is missing columns \['canonical_solution', 'test'"):
        load_task_file(pbad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_row(0)) + "\n{not json\n")
    with pytest.raises(TaskFileError, match=r"broken\.jsonl:2: not valid JSON"):
        load_task_file(broken)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(_row(0)) + "\n" + json.dumps(_row(0)) + "\n")
    with pytest.raises(TaskFileError, match="appears more than once"):
        load_task_file(dup)
    with pytest.raises(TaskFileError, match="does not exist"):
        load_task_file(tmp_path / "missing.jsonl")
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n")
    with pytest.raises(TaskFileError, match=r"must end in \.jsonl"):
        load_task_file(csv)
    with pytest.raises(TaskFileError, match="path is not set"):
        load_tasks(DatasetSettings(source="file"))
