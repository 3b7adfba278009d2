"""Config loading: shipped configs validate; errors name the file and the key path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pettingflow.configs import ConfigError, ExperimentConfig, available_configs, load_config
from pettingflow.configs.loader import (
    CONFIG_DIR,
    OVERRIDES_DOC,
    apply_override,
    dump_config,
    parse_override,
    validate_config,
)


def _base() -> dict:
    return yaml.safe_load((CONFIG_DIR / "code-env.yaml").read_text())


@pytest.mark.parametrize("name", available_configs())
def test_shipped_configs_validate(name: str) -> None:
    config = load_config(name)
    assert isinstance(config, ExperimentConfig)
    # dump -> load round trip keeps every value
    again = validate_config(yaml.safe_load(dump_config(config)))
    assert again == config


def test_code_env_defaults() -> None:
    config = load_config("code-env")
    assert [a.name for a in config.agents] == ["code_generator", "test_generator"]
    assert config.agents_of("shared") == config.agents
    # the default run: a task set SmolLM2 partly solves, groups of 4, whole held-out split before and after
    assert (config.env.dataset.source, config.env.group_size, config.env.max_turns) == ("basic-python", 4, 3)
    assert (config.validation.schedule, config.validation.num_tasks) == ("end", 30)
    assert config.inference.between_updates == "auto" and config.training.optimizer_snapshot == "background"


def test_override_sets_nested_value_and_list_item_by_name_or_index() -> None:
    config = load_config(
        "code-env",
        ["algorithm.filter_ratio=0.25", "agents.test_generator.sampling.temperature=0.5", "agents.0.sampling.top_k=5"],
    )
    assert config.algorithm.filter_ratio == 0.25
    assert config.agents[1].sampling.temperature == 0.5
    assert config.agents[0].sampling.top_k == 5


def test_wrong_type_names_key_path_and_source() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("code-env", ["algorithm.filter_ratio=abc"])
    text = str(info.value)
    assert "algorithm.filter_ratio" in text
    assert "code-env.yaml" in text
    assert "'abc'" in text


def test_unknown_key_in_file_names_file_and_path(tmp_path: Path) -> None:
    raw = _base()
    raw["algorithm"]["filter_ration"] = 0.1
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value)
    assert ("algorithm.filter_ration", info.value.problems[0][1]) == info.value.problems[0]
    assert "unknown key" in info.value.problems[0][1]


def test_unknown_key_via_override() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("code-env", ["training.no_such_knob=1"])
    assert info.value.problems[0][0] == "training.no_such_knob"


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        (["specialization=lora", "policies.0.lora.rank=0"], "policies.0.lora.rank"),
        (["agents.0.policy=missing"], "agents.0.policy"),
        (["env.group_size=1", "algorithm.filter_method=dapo"], "algorithm.filter_method"),
        (["env.group_size=1", "algorithm.advantage_estimator=rloo"], "env.group_size"),
        (["training.max_seq_len=4096"], "training.max_seq_len"),
        (["training.skip_zero_advantage_rows=true", "algorithm.kl_coef=0.01"], "training.skip_zero_advantage_rows"),
        (
            ["training.skip_zero_advantage_rows=true", "algorithm.entropy_coef=0.01"],
            "training.skip_zero_advantage_rows",
        ),
        (["training.head_at_loss_positions=false", "training.head_chunk_tokens=256"], "training"),
        (["training.master_weights=bf16", "training.zero_stage=2"], "training"),
        (["inference.url=http://a:1", "inference.urls=[http://b:1]"], "inference.urls"),
        (["inference.urls=[http://a:1,http://b:1]", "inference.replicas=2"], "inference.replicas"),
    ],
)
def test_impossible_combinations(overrides: list[str], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("code-env", overrides)
    assert path in [p for p, _ in info.value.problems], info.value.problems


def test_prompt_specialization_with_two_policies_is_rejected() -> None:
    raw = _base()
    raw["policies"].append({"name": "other"})
    raw["agents"][1]["policy"] = "other"
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert "specialization" in [p for p, _ in info.value.problems]
    raw["specialization"] = "full"
    assert validate_config(raw).specialization.value == "full"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("no_equals_sign", "key.path=value"),
        ("agents.7.policy=x", "agents[7]: the config has 2 agents (0..1)"),
        ("agents.nobody.policy=x", "no agent named 'nobody'"),
    ],
)
def test_bad_override_syntax(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("code-env", [override])
    assert needle in str(info.value)


def _agent(config: ExperimentConfig, name: str):
    return next(a for a in config.agents if a.name == name)


@pytest.mark.parametrize(
    "selector", ["agents[1]", "agents.1", "agents[-1]", "agents.-1", "agents.test_generator"], ids=str
)
def test_a_list_entry_is_picked_by_index_in_brackets_dotted_or_by_name(selector: str) -> None:
    """Every form changes the second agent and only it."""
    base = load_config("code-env")
    config = load_config(
        "code-env", [f"{selector}.sampling.temperature=0.25", f"{selector}.class_path=mypkg.agents:Reviewer"]
    )
    changed = _agent(config, "test_generator")
    assert (changed.sampling.temperature, changed.class_path) == (0.25, "mypkg.agents:Reviewer")
    assert _agent(config, "code_generator") == _agent(base, "code_generator")


@pytest.mark.parametrize("selector", ["policies[0]", "policies.0", "policies.shared"], ids=str)
def test_policies_are_picked_the_same_ways(selector: str) -> None:
    assert load_config("code-env", [f"{selector}.model=/models/other"]).policies[0].model == "/models/other"


def test_brackets_and_dotted_indexes_parse_to_the_same_parts() -> None:
    """Callers that read the parts (a re-run checks parts[0] and the dotted key) see one form."""
    bracketed, value = parse_override("policies[0].lora.target_modules[1]=v_proj")
    dotted, _ = parse_override("policies.0.lora.target_modules.1=v_proj")
    assert bracketed == dotted == ["policies", "0", "lora", "target_modules", "1"]
    assert value == "v_proj"


def test_an_entry_of_a_nested_list_is_set_by_index() -> None:
    data = {"policies": [{"name": "p", "lora": {"target_modules": ["q_proj", "k_proj"]}}]}
    apply_override(data, *parse_override("policies[0].lora.target_modules[1]=v_proj"))
    assert data["policies"][0]["lora"]["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("override", "path", "needle"),
    [
        ("agents[5].policy=x", "agents[5]", "the config has 2 agents (0..1)"),
        ("agents.5.policy=x", "agents[5]", "the config has 2 agents (0..1)"),
        ("agents[-3].policy=x", "agents[-3]", "the config has 2 agents (0..1)"),
        ("policies[1].model=x", "policies[1]", "the config has 1 policy (0..0)"),
        ("agents.reviewer.policy=x", "agents.reviewer", "the config's agents: code_generator, test_generator"),
        ("policies.main.model=x", "policies.main", "no policy named 'main'; the config's policies: shared"),
        ("agents.sampling.temperature=1", "agents.sampling", "no agent named 'sampling'"),
        ("agents[1].sampling.temprature=1", "agents.1.sampling.temprature", "unknown key"),
        ("agents.test_generator.nosuch=1", "agents.1.nosuch", "unknown key"),
        ("agents[code_generator].policy=x", "agents[code_generator].policy", "name: agents.code_generator"),
        ("agents[].policy=x", "agents[].policy", "brackets hold a whole number"),
        ("agents[1]x.policy=x", "agents[1]x.policy", "cannot read segment 'agents[1]x'"),
        ("env.dataset[0]=x", "env.dataset[0]", "env.dataset is a mapping, not a list"),
        ("run.code_paths[0]=x", "run.code_paths[0]", "set the whole list: run.code_paths=[...]"),
        ("agent[1].policy=x", "agent[1]", "check the spelling"),
        ("env.max_turns[0]=1", "env.max_turns[0]", "env.max_turns is 3 (int): it has no keys or entries"),
    ],
)
def test_a_bad_list_override_names_its_key_and_what_is_there(override: str, path: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("code-env", [override])
    problems = dict(info.value.problems)
    assert path in problems and needle in problems[path], info.value.problems


def test_a_name_two_entries_share_is_refused_before_validation() -> None:
    """Overrides apply before validation (which rejects duplicate names), so a name must pick exactly one."""
    data = {"agents": [{"name": "a"}, {"name": "a"}]}
    with pytest.raises(ConfigError, match=r"2 agents are named 'a' \(at 0, 1\); pick one by index"):
        apply_override(data, ["agents", "a", "policy"], "x")
    apply_override(data, *parse_override("agents[1].policy=x"))
    assert data["agents"][1] == {"name": "a", "policy": "x"}


def test_entries_without_names_are_picked_by_index_only() -> None:
    data = {"run": {"code_paths": ["src", "lib"]}}
    with pytest.raises(ConfigError, match=r"no names: pick one by index, run.code_paths\[0\]..run.code_paths\[1\]"):
        apply_override(data, ["run", "code_paths", "src"], "x")
    with pytest.raises(ConfigError, match=r"run.code_paths is empty here"):
        apply_override({"run": {"code_paths": []}}, *parse_override("run.code_paths[0]=x"))


def test_the_error_lines_on_the_reference_page_are_what_the_loader_says() -> None:
    """docs/reference/config.md shows three errors (configs/loader.py's OVERRIDES_DOC); each must be a line the
    loader prints for its override, so a reworded message cannot leave the page behind."""
    shown = OVERRIDES_DOC.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    printed = []
    for override in ["agents[5].policy=x", "agents.reviewer.policy=x", "agents[1].sampling.temprature=1"]:
        with pytest.raises(ConfigError) as info:
            load_config("code-env", [override])
        printed += [f"{path}: {problem}" for path, problem in info.value.problems]
    assert printed == shown


def test_unknown_config_name_lists_shipped_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("no-such-config")
    assert "code-env" in str(info.value)


def test_apply_override_creates_missing_maps() -> None:
    data: dict = {}
    apply_override(data, ["a", "b", "c"], 1)
    assert data == {"a": {"b": {"c": 1}}}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pettingflow.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_config_show_prints_resolved_yaml() -> None:
    out = _cli("config", "show", "code-env", "env.group_size=6")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["env"]["group_size"] == 6
    assert shown["algorithm"]["filter_method"] == "dapo"


def test_cli_config_show_invalid_exits_nonzero_naming_key() -> None:
    out = _cli("config", "show", "code-env", "algorithm.filter_ratio=abc")
    assert out.returncode != 0
    assert "algorithm.filter_ratio" in out.stderr
    assert "Traceback" not in out.stderr


def test_every_shipped_config_loads_and_is_named_after_its_file() -> None:
    """A config in configs/ that does not validate (or carries another config's run name, so its runs
    would be filed under the wrong name) fails here, not hours into a learning run."""
    from pettingflow.configs.loader import CONFIG_DIR, load_config

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"code-env", "plan-path", "code-env-learn-tree", "plan-path-learn-tree"} <= set(names)
    for name in names:
        assert load_config(name, []).run.name == name, name


def test_every_deployment_names_real_parameters_and_configs() -> None:
    """A deployment is checked by Prefect only when it runs (minutes into a worker): its parameters must bind to
    the flow's signature (those given at run time aside), and every config it names must load with its overrides."""
    import importlib
    import inspect

    deployments = yaml.safe_load((CONFIG_DIR.parent / "prefect.yaml").read_text())["deployments"]
    assert deployments
    for deployment in deployments:
        path, name = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module("pettingflow.flows." + Path(path).stem), name)
        params = deployment.get("parameters", {})
        inspect.signature(flow.fn).bind_partial(**params)  # TypeError: an unknown parameter
        overrides = params.get("overrides", [])
        for config in params.get("configs", [params["config"]] if "config" in params else []):
            load_config(config, overrides)


def test_a_stored_run_with_the_old_boolean_snapshot_setting_still_loads() -> None:
    """``training.save_optimizer_state`` was replaced by ``save_optimizer_every``; a run.json written before says
    true (a snapshot every update) or false (never), and is read as that cadence."""
    raw = load_config("code-env").model_dump(mode="json")
    for stored, every in ((True, 1), (False, 0)):
        old = {**raw, "training": {**raw["training"], "save_optimizer_state": stored}}
        old["training"].pop("save_optimizer_every")
        assert validate_config(old).training.save_optimizer_every == every
    with pytest.raises(ConfigError, match="save_optimizer_stat"):
        load_config("code-env", ["training.save_optimizer_stat=true"])  # a typo is still refused


def test_a_config_extends_another_and_says_only_what_differs(tmp_path: Path) -> None:
    """``extends``: the parent's keys, this file's merged over them (maps key by key, lists replaced whole);
    a chain works, a cycle fails naming the files."""
    (tmp_path / "parent.yaml").write_text("extends: code-env\nrun: {name: parent, iterations: 5}\n")
    (tmp_path / "child.yaml").write_text(
        "extends: parent.yaml\nrun: {name: child}\nenv: {group_size: 1}\n"
        "rollout: {mode: tree, tree: {branches: 4, team_credit: round}}\n"
    )
    child, base = load_config(str(tmp_path / "child.yaml")), load_config("code-env")
    assert (child.run.name, child.run.iterations) == ("child", 5)  # from the child, then the parent
    assert child.rollout.tree.team_credit == "round" and child.agents == base.agents  # the rest from code-env
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "bad.yaml").write_text("extends: [code-env]\n")
    with pytest.raises(ConfigError, match="must name one config"):
        load_config(str(tmp_path / "bad.yaml"))
