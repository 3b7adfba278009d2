"""What a learning run shows: held-out scores before and after training, and the curves in between.

``flows/learn.py`` trains several configs (e.g. the code agent alone and the two-agent team) on the
same tasks and budget and hands each one's numbers to the functions here, which turn them into one
JSON document, one PNG and one markdown table. Nothing here starts a server or a flow, so the
summary can be rebuilt from stored runs (``pettingflow runs learning-report``) without training again.
This module finds the runs and their evaluations and assembles each arm; the statistics are in
``stats.py`` (pure), the table and the figure in ``figures.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pettingflow.analysis import outcomes
from pettingflow.analysis.figures import (
    HEADLINE_AGENT,
    comparison_table,
    learning_png,
    markdown_table,
    role_swap_table,
    summary_table,
)
from pettingflow.analysis.stats import first_last_mean, paired_arm_difference, paired_bootstrap
from pettingflow.steps.report import history
from pettingflow.storage import RunLayout
from pettingflow.storage.layout import StepName


@dataclass
class ArmResult:
    """One config's run: where it is, held-out scores before/after, and the per-iteration curve."""

    config: str
    run_id: str
    run_uri: str
    before: dict[str, dict[str, dict[str, float]]]  # view -> agent -> {success_rate, reward_mean, episodes}
    after: dict[str, dict[str, dict[str, float]]]
    curve: list[dict[str, float]] = field(default_factory=list)  # one point per iteration
    wall_s: float = 0.0
    evaluations: dict[str, dict[str, str]] = field(default_factory=dict)  # before/after -> view -> eval run id
    paired: dict[str, dict[str, float]] = field(default_factory=dict)  # view -> paired_bootstrap(...)
    revisits: dict[str, float] | None = None  # revisited_train_tasks(...)
    headline_agent: str = HEADLINE_AGENT  # whose last-turn success is the episode's outcome (outcome_agent)
    seed: int | None = None  # the run's run.seed: arms of one seed are compared with each other
    #: before/after -> view -> held-out task position -> the headline agent's final success per sample
    outcomes: dict[str, dict[str, dict[int, list[bool]]]] = field(default_factory=dict)

    def headline(self, when: str, view: str = "sampled") -> float | None:
        """The headline agent's held-out success rate ``before`` or ``after`` training, in one view."""
        scores = (self.before if when == "before" else self.after).get(view, {})
        agent = scores.get(self.headline_agent)
        return None if agent is None else agent.get("success_rate")

    @property
    def tokens_generated(self) -> int:
        """Tokens the policy generated in training (rollouts of every iteration): the compute budget."""
        return int(sum(p.get("tokens_generated", 0.0) for p in self.curve))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArmResult:
        """The inverse of ``to_json``: JSON turned the held-out task positions of ``outcomes`` into strings."""
        known = {f.name for f in fields(cls)}
        arm = cls(**{k: v for k, v in data.items() if k in known})
        arm.outcomes = {
            when: {
                view: {int(task): list(samples) for task, samples in by_task.items()} for view, by_task in views.items()
            }
            for when, views in arm.outcomes.items()
        }
        return arm


def arms_from_learning_json(uri: str, storage_options: dict[str, Any] | None = None) -> list[ArmResult]:
    """The arms stored in a ``learning.json``: a file, the folder holding it, or a folder of such folders.

    Why: a study run over several sessions or machines cannot rely on the run folders travelling; the
    ``learning.json`` that each invocation writes holds every number the report needs (scores, per-task outcomes,
    curves), so committed copies of it combine into one report. A folder of reports (one per seed or session, as
    a study commits them) is read whole, so the study's table is one command however many parts it took."""
    import json

    import fsspec

    fs, root = fsspec.core.url_to_fs(uri.rstrip("/"), **(storage_options or {}))
    if root.endswith(".json"):
        paths = [root] if fs.isfile(root) else []
    elif fs.isfile(f"{root}/learning.json"):
        paths = [f"{root}/learning.json"]
    else:
        paths = sorted(p for p in (fs.find(root) if fs.isdir(root) else []) if p.endswith("/learning.json"))
    if not paths:
        raise FileNotFoundError(
            f"no learning report at {uri}: pass a learning.json, the folder holding it, or a folder of such folders"
        )
    arms = []
    for path in paths:
        with fs.open(path, "r") as fh:
            data = json.load(fh)
        if not isinstance(data, dict) or not isinstance(data.get("arms"), list):
            raise ValueError(f"{path} is not a learning report: it has no 'arms' list (written by `learn`)")
        arms += [ArmResult.from_json(arm) for arm in data["arms"]]
    return arms


def combine_arms(arms: Sequence[ArmResult]) -> list[ArmResult]:
    """Arms gathered from several reports and runs, each run once; a config may appear once per seed.

    Why: comparisons pair arms by (config, seed), so a second run of one pair would silently replace the first."""
    by_run: dict[str, ArmResult] = {}
    for arm in arms:
        by_run.setdefault(arm.run_id, arm)
    seen: dict[tuple[str, int | None], str] = {}
    for arm in by_run.values():
        key = (arm.config, arm.seed)
        if key in seen:
            raise ValueError(
                f"two runs of {arm.config} with seed {arm.seed}: {seen[key]} and {arm.run_id}; "
                "a report pairs arms by config and seed, so pass one of them"
            )
        seen[key] = arm.run_id
    return list(by_run.values())


def run_curve(layout: RunLayout, agent: str = HEADLINE_AGENT) -> list[dict[str, float]]:
    """Per iteration: the agent's train reward mean / success rate and, where validated, held-out success."""
    points = []
    for report in history(layout):
        point = {"iteration": float(report["iteration"])}
        for key, name in (
            (f"{StepName.ROLLOUTS}/{agent}/reward_mean", "train_reward"),
            (f"{StepName.ROLLOUTS}/{agent}/success_rate", "train_success"),
            (f"{StepName.VALIDATION}/{agent}/success_rate", "heldout_success"),
            (f"{StepName.VALIDATION}/{agent}/reward_mean", "heldout_reward"),
            (f"{StepName.ROLLOUTS}/tokens_generated", "tokens_generated"),
            (f"{StepName.FILTERED}/rows_kept", "rows_trained"),
        ):
            if key in report:
                point[name] = float(report[key])
        points.append(point)
    return points


def outcome_agent(config: Any) -> str:
    """The agent whose last-turn success is an episode's outcome: the first of the config's agents whose
    class sets ``decides_outcome`` (the code writer, the plan-path executor or walker).

    Why not "every agent": in a team, the test writer's success says its tests were right, not that the
    task was solved; the comparison of a team with a single agent needs the one outcome they share.
    """
    from pettingflow.agents import resolve_agent_class

    for agent in config.agents:
        if getattr(resolve_agent_class(agent.class_path), "decides_outcome", False):
            return agent.name
    raise ValueError(
        f"none of the agents {[a.name for a in config.agents]} decides the episode's outcome; set "
        "`decides_outcome = True` on the agent class whose last turn is the task's result"
    )


def last_turns(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, int], Mapping[str, Any]]:
    """(agent, held-out task position ``env_idx``, sample) -> the agent's last turn on that episode's path.

    An episode's outcome for an agent is its last turn (the revised code in the two-agent team).
    """
    return outcomes.last_turns(rows)


def final_successes(
    rows: Sequence[Mapping[str, Any]], agent: str = HEADLINE_AGENT, asked: Sequence[tuple[int, int]] | None = None
) -> dict[int, list[bool]]:
    """Held-out task -> the agent's final success in each sampled episode (sample order), over every ``asked``
    episode: one that ended before the agent's turn is a failure, not left out (``analysis/outcomes.py``)."""
    return outcomes.episode_successes(rows, agent, asked)


def asked_of(layout: RunLayout, step_name: str, iteration: int = 0) -> list[tuple[int, int]] | None:
    """The episodes a committed step of ``layout`` asked for (``outcomes.step_request``); None where it does not
    say which tasks it ran."""
    from pettingflow.runs.run import RunRef, load_run_config

    step = layout.step(iteration, step_name)
    config = load_run_config(RunRef(root=layout.root, run_id=layout.run_id, storage_options=layout.storage_options))
    request = outcomes.step_request(step.manifest().metadata, config, step_name)
    return None if request is None else outcomes.asked_episodes(*request)


def revisited_train_tasks(layout: RunLayout, agent: str = HEADLINE_AGENT) -> dict[str, float] | None:
    """Train tasks drawn twice (the task order wraps after an epoch): success at the first draw vs the last.

    Why: the reward of one iteration mostly reflects which 8 tasks were drawn, so a per-iteration curve
    is noisy. The same task sampled again later, with the same G, is a paired comparison that only the
    training in between can explain (plus sampling noise, which the interval covers). None when no
    task was drawn twice (fewer iterations than one epoch).
    """
    from pettingflow.envs.humaneval import task_key
    from pettingflow.runs.run import RunRef, load_run_config
    from pettingflow.steps.rollouts import select_train_tasks
    from pettingflow.storage import read_step_trajectories

    config = load_run_config(RunRef(root=layout.root, run_id=layout.run_id, storage_options=layout.storage_options))
    visits: dict[str, list[list[bool]]] = {}
    for k in layout.iterations():
        step = layout.step(k, StepName.ROLLOUTS)
        if not step.is_committed():
            continue
        cols = ["env_idx", "sample_idx", "turn_idx", "agent_name", "success", "continued"]
        request = outcomes.step_request(step.manifest().metadata, config, StepName.ROLLOUTS)
        asked = None if request is None else outcomes.asked_episodes(*request)
        by_position = final_successes(read_step_trajectories(step).select(cols).to_pylist(), agent, asked)
        tasks = select_train_tasks(config, k)
        for position, successes in by_position.items():
            visits.setdefault(task_key(tasks[position]), []).append(successes)
    twice = {task: v for task, v in visits.items() if len(v) >= 2}
    if not twice:
        return None
    names = sorted(twice)
    first = {i: twice[t][0] for i, t in enumerate(names)}
    last = {i: twice[t][-1] for i, t in enumerate(names)}
    out = paired_bootstrap(first, last)
    out["first_mean"] = sum(sum(v) / len(v) for v in first.values()) / len(first)
    out["last_mean"] = sum(sum(v) / len(v) for v in last.values()) / len(last)
    return out


def eval_view(info: Mapping[str, Any]) -> str:
    """``swapped`` for an evaluation with the roles swapped (the positive control), ``greedy`` for a one-answer,
    temperature-0 evaluation, else ``sampled`` (see ``flows/learn.py``)."""
    if (info.get("evaluates") or {}).get("roles_swapped"):
        return "swapped"
    val = info["config"]["validation"]
    return "greedy" if val["temperature"] == 0 and val.get("samples_per_task", 1) == 1 else "sampled"


def find_evaluations(
    root: str, run_id: str, storage_options: dict[str, Any] | None = None
) -> dict[str, dict[str, str]]:
    """The ``evaluate`` runs that belong to training run ``run_id``: before/after -> view -> eval run id.

    After: evaluations of this run's weights (the newest per view). Before: the newest base-model
    evaluation of the same config created before the training run, which is what ``learn`` makes.
    """
    from pettingflow.storage import list_runs

    trained = RunLayout(root, run_id, storage_options).read_run_info()
    found: dict[str, dict[str, tuple[str, str]]] = {"before": {}, "after": {}}
    for other in list_runs(root, storage_options):
        info = RunLayout(root, other, storage_options).read_run_info()
        source = info.get("evaluates")
        if not source:
            continue
        if source.get("run_id") == run_id:
            when = "after"
        elif (
            source.get("weights") == "base"
            and info.get("config_name") == trained.get("config_name")
            and info["created"] < trained["created"]
        ):
            when = "before"
        else:
            continue
        view = eval_view(info)
        if view not in found[when] or info["created"] > found[when][view][0]:
            found[when][view] = (info["created"], other)
    return {when: {view: rid for view, (_, rid) in views.items()} for when, views in found.items()}


def arm_from_runs(
    root: str,
    run_id: str,
    storage_options: dict[str, Any] | None = None,
    evaluations: dict[str, dict[str, str]] | None = None,
) -> ArmResult:
    """One arm of a learning run, from what is stored: the training run and its ``evaluate`` runs.

    ``evaluations`` (before/after -> view -> eval run id) when the caller knows them (``flows/learn.py``);
    otherwise they are looked up with ``find_evaluations``. Each eval run's trajectories are read once.
    """
    from pettingflow.runs.run import RunRef, load_run_config

    evaluations = evaluations or find_evaluations(root, run_id, storage_options)
    missing = [w for w in ("before", "after") if "sampled" not in evaluations.get(w, {})]
    if missing:
        raise ValueError(
            f"run {run_id!r} has no {' or '.join(missing)} evaluation under {root}; run the evaluate flow "
            f"(base model for 'before', run_id={run_id} for 'after') or `make learn`"
        )
    rows = {
        when: {view: read_trajectories_of(RunLayout(root, eid, storage_options)) for view, eid in views.items()}
        for when, views in evaluations.items()
    }
    asked = {
        when: {
            view: asked_of(RunLayout(root, eid, storage_options), StepName.VALIDATION) for view, eid in views.items()
        }
        for when, views in evaluations.items()
    }
    trained = RunLayout(root, run_id, storage_options)
    config = load_run_config(RunRef(root=root, run_id=run_id, storage_options=storage_options or {}))
    agent = outcome_agent(config)
    scored = {
        when: {view: final_successes(r, agent, asked[when][view]) for view, r in views.items()}
        for when, views in rows.items()
    }
    return ArmResult(
        config=trained.read_run_info()["config_name"],
        run_id=run_id,
        run_uri=trained.run_uri,
        before={view: agent_scores(r, asked["before"][view]) for view, r in rows["before"].items()},
        after={view: agent_scores(r, asked["after"][view]) for view, r in rows["after"].items()},
        curve=run_curve(trained, agent),
        revisits=revisited_train_tasks(trained, agent),
        evaluations=evaluations,
        paired={
            view: paired_bootstrap(scored["before"][view], after)
            for view, after in scored["after"].items()
            if view in scored["before"]
        },
        headline_agent=agent,
        seed=config.run.seed,
        outcomes=scored,
    )


def read_trajectories_of(layout: RunLayout) -> list[dict[str, Any]]:
    """The validation rows of an ``evaluate`` run (the columns the scores need)."""
    from pettingflow.storage import read_step_trajectories

    table = read_step_trajectories(layout.step(0, StepName.VALIDATION))
    columns = ["env_name", "env_idx", "sample_idx", "turn_idx", "agent_name", "success", "reward", "continued"]
    return table.select(columns).to_pylist()


def agent_scores(
    rows: Sequence[Mapping[str, Any]], asked: Sequence[tuple[int, int]] | None = None
) -> dict[str, dict[str, float]]:
    """Per agent over every ``asked`` episode of stored rows: the scores rollouts report (``outcomes.agent_scores``:
    an episode that ended before the agent's turn counts as reward 0, no success)."""
    return outcomes.agent_scores(rows, asked)


def results_table(arms: Sequence[ArmResult]) -> list[dict[str, Any]]:
    """One row per arm: held-out success before/after and the train reward at the start and the end."""
    rows = []
    for arm in arms:
        train = [p["train_reward"] for p in arm.curve if "train_reward" in p]
        start, end = first_last_mean(train)
        before, after = arm.headline("before"), arm.headline("after")
        rows.append(
            {
                "config": arm.config,
                "heldout_before": before,
                "heldout_after": after,
                "heldout_delta": None if before is None or after is None else after - before,
                "heldout_ci95": _ci(arm.paired.get("sampled")),
                "revisit_first": None if arm.revisits is None else arm.revisits["first_mean"],
                "revisit_last": None if arm.revisits is None else arm.revisits["last_mean"],
                "revisit_ci95": _ci(arm.revisits),
                "revisit_tasks": None if arm.revisits is None else int(arm.revisits["tasks"]),
                "greedy_before": arm.headline("before", "greedy"),
                "greedy_after": arm.headline("after", "greedy"),
                "swapped_after": arm.headline("after", "swapped"),  # the positive control (None: not swappable)
                "train_reward_first4": start,
                "train_reward_last4": end,
                "iterations": len(arm.curve),
                "seed": arm.seed,
                "headline_agent": arm.headline_agent,
                "tokens_generated": arm.tokens_generated,
                "wall_s": arm.wall_s,
                "rows_trained": int(sum(p.get("rows_trained", 0.0) for p in arm.curve)),
                "run_id": arm.run_id,
            }
        )
    return rows


def compare_arms(arms: Sequence[ArmResult], view: str = "sampled") -> list[dict[str, Any]]:
    """Every pair of configs (in the order given) that share seeds: config A's held-out change minus
    config B's, paired by seed and by held-out task (``stats.paired_arm_difference``).

    Why changes and not final scores: arms with other agents (a team vs one agent) start from other
    prompts, so their base scores differ; where the base evaluation is the same (tree vs independent
    sampling of one team) the difference of changes is the difference of final scores.
    """
    by_config: dict[str, dict[int | None, ArmResult]] = {}
    for arm in arms:
        by_config.setdefault(arm.config, {})[arm.seed] = arm
    names = list(by_config)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            seeds = sorted((set(by_config[a]) & set(by_config[b])) - {None})
            pairs = [(by_config[a][s], by_config[b][s]) for s in seeds]
            pairs = [(x, y) for x, y in pairs if _has_view(x, view) and _has_view(y, view)]
            if not pairs:
                continue
            diff = paired_arm_difference(
                [(x.outcomes["before"][view], x.outcomes["after"][view]) for x, _ in pairs],
                [(y.outcomes["before"][view], y.outcomes["after"][view]) for _, y in pairs],
            )
            out.append(
                {
                    "a": a,
                    "b": b,
                    "view": view,
                    "seeds": [x.seed for x, _ in pairs],
                    "a_before": [x.headline("before", view) for x, _ in pairs],
                    "a_after": [x.headline("after", view) for x, _ in pairs],
                    "b_before": [y.headline("before", view) for _, y in pairs],
                    "b_after": [y.headline("after", view) for _, y in pairs],
                    "a_tokens": [x.tokens_generated for x, _ in pairs],
                    "b_tokens": [y.tokens_generated for _, y in pairs],
                    **diff,
                }
            )
    return out


def config_summaries(arms: Sequence[ArmResult], view: str = "sampled") -> list[dict[str, Any]]:
    """Per config over its seeds: mean held-out score before and after, the change with its intervals over tasks
    and over seeds (``stats.paired_arm_difference`` without a second arm), and the mean budget and cost.

    Why: a study of several configs times several seeds has a row per run; this is the row per config that a reader
    compares first, with the spread between seeds next to it."""
    out = []
    for config, runs in _seeds_by_config(arms, lambda arm: _has_view(arm, view)).items():
        change = paired_arm_difference([(x.outcomes["before"][view], x.outcomes["after"][view]) for x in runs])
        out.append(
            {
                "config": config,
                "view": view,
                "seeds": [x.seed for x in runs],
                "before": _mean([x.headline("before", view) for x in runs]),
                "after": _mean([x.headline("after", view) for x in runs]),
                "tokens_generated": _mean([x.tokens_generated for x in runs]),
                "iterations": _mean([len(x.curve) for x in runs]),
                "wall_s": _mean([x.wall_s or None for x in runs]),  # 0: rebuilt from runs, not timed
                **change,
            }
        )
    return out


def _seeds_by_config(arms: Sequence[ArmResult], keep: Callable[[ArmResult], bool]) -> dict[str, list[ArmResult]]:
    """config -> its arms that ``keep`` accepts, in seed order (the order of every per-seed column)."""
    by_config: dict[str, list[ArmResult]] = {}
    for arm in arms:
        if keep(arm):
            by_config.setdefault(arm.config, []).append(arm)
    return {c: sorted(runs, key=lambda arm: -1 if arm.seed is None else arm.seed) for c, runs in by_config.items()}


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def role_swap_effects(arms: Sequence[ArmResult]) -> list[dict[str, Any]]:
    """Per config scored with its roles swapped after training: the swapped score minus the score as trained,
    paired by seed and held-out task (``stats.paired_arm_difference`` without a second arm).

    Why: the positive control of a study. Roles that training specialised should fail when swapped (PettingLLMs
    reports 96 -> 6 on plan-path); the interval and the detectable effect say whether this design could see that,
    and so whether it could see a smaller effect between arms. Both evaluations use the same tasks and seeds.
    """
    out = []
    swapped = _seeds_by_config(arms, lambda arm: {"sampled", "swapped"} <= set(arm.outcomes.get("after", {})))
    for config, runs in swapped.items():
        diff = paired_arm_difference([(x.outcomes["after"]["sampled"], x.outcomes["after"]["swapped"]) for x in runs])
        out.append(
            {
                "config": config,
                "seeds": [x.seed for x in runs],
                "trained": [x.headline("after") for x in runs],
                "swapped": [x.headline("after", "swapped") for x in runs],
                **diff,
            }
        )
    return out


def _has_view(arm: ArmResult, view: str) -> bool:
    return all(view in arm.outcomes.get(when, {}) for when in ("before", "after"))


def _ci(paired: Mapping[str, float] | None) -> list[float] | None:
    return None if not paired else [paired["ci95_low"], paired["ci95_high"]]


def write_learning_report(
    arms: Sequence[ArmResult], out_uri: str, storage_options: dict[str, Any] | None = None, **extra: Any
) -> str:
    """``learning.json`` (every number), ``learning.png`` and ``learning.md`` under ``out_uri``; returns the table."""
    import json

    import fsspec

    rows = results_table(arms)
    comparisons = compare_arms(arms)
    swaps = role_swap_effects(arms)
    summaries = config_summaries(arms)
    table = markdown_table(rows)
    if any(len(c["seeds"]) > 1 for c in summaries):
        table += "\n\n" + summary_table(summaries)
    if comparisons:
        table += "\n\n" + comparison_table(comparisons)
    if swaps:
        table += "\n\n" + role_swap_table(swaps)
    fs, root = fsspec.core.url_to_fs(out_uri, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/learning.json", "w") as fh:
        document = {
            **extra,
            "rows": rows,
            "configs_over_seeds": summaries,
            "comparisons": comparisons,
            "role_swaps": swaps,
            "arms": [a.to_json() for a in arms],
        }
        json.dump(document, fh, indent=2)
    with fs.open(f"{root}/learning.png", "wb") as fh:
        fh.write(learning_png(arms))
    with fs.open(f"{root}/learning.md", "w") as fh:
        fh.write(table + "\n")
    return table
