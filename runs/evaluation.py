"""Scoring any weights after training: a run's, a model folder's, a hub model's or the base model's.

``pettingflow eval``, ``pettingflow play`` and the ``evaluate`` flow (which ``learn`` calls) all score through
``evaluate_weights``: it opens an evaluation run of its own (``run.json`` records what it evaluates), makes the
servers serve the weights, and runs ``steps.rollouts.validation_step``, the same episodes-and-commit code the
``train`` flow validates with. The scores are then read back from the committed rows with ``analysis.outcomes``
(every asked episode counts; one that ended before an agent's turn is a failure for it), so a stored evaluation
and a fresh one read alike, and two evaluations of the same tasks and seeds pair task by task
(``analysis.stats.paired_bootstrap``).

Why one module and not a second loop in the CLI: a success rate is only comparable with the run summary's when
it is computed over the same episodes, with the same seeds, by the same code.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pettingflow.configs.loader import validate_config, validate_stored_config
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.run import RunRef, start_or_resume
from pettingflow.steps.outcome import StepOutcome
from pettingflow.storage import RunLayout, new_run_id, read_step_trajectories
from pettingflow.storage.layout import StepName

log = logging.getLogger(__name__)

BASE = "base"
SPLITS = ("validation", "train", "all")
#: the sections of a trained run's config that say what its weights are and which agent each serves; everything
#: else (tasks, validation, inference, rollout, seeds) comes from the config the evaluation names, so that two
#: evaluations of one command run the same tasks with the same seeds
WEIGHT_SECTIONS = ("policies", "agents", "specialization")
REPORT_JSON, REPORT_MD = "evaluation.json", "evaluation.md"


class WeightsError(ValueError):
    """``--weights`` names nothing that can be scored, or weights that are gone; the message says what to give."""


class NoUpdateError(WeightsError):
    """A run with no committed update that changed weights: what it would serve is the base model."""


@dataclass(frozen=True)
class Weights:
    """What ``--weights`` named: ``base`` (the config's base models), a run's weights after an iteration, or a
    model (a folder, a prepared name or a hub id from the local cache) served for every policy."""

    kind: Literal["base", "run", "model"]
    spec: str  # as the user wrote it
    run_id: str | None = None
    root: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    iteration: int | None = None  # run: the weights after this iteration (None: its last)
    model: str | None = None  # model: as given (resolved by ``inference.models.resolve_model`` where served)

    def source(self) -> dict[str, Any]:
        """The ``evaluates`` record of ``run.json`` (``analysis.learning.find_evaluations`` reads it)."""
        if self.kind == "run":
            return {"weights": "run", "run_id": self.run_id, "after_iteration": self.iteration}
        if self.kind == "model":
            return {"weights": "model", "model": self.model}
        return {"weights": BASE}

    def label(self) -> str:
        """How a report names these weights: ``base``, ``RUN after iteration K``, or the model as given."""
        if self.kind == "run":
            return f"{self.run_id} after iteration {self.iteration}"
        return self.model or BASE

    def layout(self) -> RunLayout:
        if self.kind != "run" or self.run_id is None or self.root is None:
            raise ValueError(f"{self.spec!r} names no run")
        return RunLayout(self.root, self.run_id, self.storage_options)


def parse_weights(
    spec: str, root: str, storage_options: dict[str, Any] | None = None, *, require_update: bool = True
) -> Weights:
    """What ``spec`` names, checked against storage before anything starts.

    In order: ``base``; an existing folder; ``RUN:ITER`` or ``RUN`` for a run under ``root`` (its weights after
    iteration ITER, default its last); else a prepared model name or a hub id, resolved as ``models prepare``
    resolves them (the local cache only). ``require_update``: refuse a run without a committed update that
    changed weights (its weights would be the base model's: say so rather than score the base as "trained")."""
    from pathlib import Path

    from pettingflow.inference.models import ModelError, resolve_model

    text = spec.strip()
    if not text:
        raise WeightsError("--weights is empty: give base, a run id (RUN or RUN:ITER), a model folder or a hub id")
    if text == BASE:
        return Weights("base", text)
    if Path(text).expanduser().is_dir():
        try:
            return Weights("model", text, model=str(resolve_model(text)))
        except ModelError as exc:
            raise WeightsError(f"--weights {text}: {exc}") from None
    run_id, _, iteration = text.partition(":")
    layout = _run_layout(run_id, root, storage_options)
    if layout is not None:
        return Weights(
            "run",
            text,
            run_id=run_id,
            root=root,
            storage_options=dict(storage_options or {}),
            iteration=_checked_iteration(layout, _iteration(text, iteration) if iteration else None, require_update),
        )
    if iteration:
        raise WeightsError(f"--weights {text}: no run {run_id!r} under {root} (`pettingflow runs list` shows runs)")
    try:
        resolve_model(text)
    except ModelError as exc:
        raise WeightsError(f"--weights {text}: not base, not a run under {root} and not a model ({exc})") from None
    return Weights("model", text, model=text)


def _checked_iteration(layout: RunLayout, iteration: int | None, require_update: bool) -> int:
    try:
        return run_iteration(layout, iteration, require_update)
    except NoUpdateError as exc:
        raise WeightsError(f"{exc}; score base instead (--weights base)") from None


def _iteration(spec: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WeightsError(f"--weights {spec}: ITER in RUN:ITER must be an iteration number, got {text!r}") from None
    if value < 0:
        raise WeightsError(f"--weights {spec}: iterations are numbered from 0")
    return value


def run_exists(run_id: str, root: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``run_id`` is a run (it has a ``run.json``) under ``root``."""
    return _run_layout(run_id, root, storage_options) is not None


def _run_layout(run_id: str, root: str, storage_options: dict[str, Any] | None) -> RunLayout | None:
    """The run's layout when ``run_id`` is a run under ``root``, else None."""
    try:
        layout = RunLayout(root, run_id, storage_options)
    except ValueError:  # not a run id at all (a hub id's slash, say)
        return None
    try:
        layout.read_run_info()
    except FileNotFoundError:
        return None
    return layout


def run_iteration(layout: RunLayout, iteration: int | None, require_update: bool = True) -> int:
    """The iteration whose weights a run's evaluation serves: ``iteration`` (checked), or the run's last.

    Refused in one line: an iteration the run does not have, weights removed by ``runs prune``, and (with
    ``require_update``) a run with no committed update at or before it: what it would serve is the base model."""
    from pettingflow.runs.lineage import pruned_weights

    ran = layout.iterations()
    if not ran:
        raise WeightsError(f"run {layout.run_id!r} has no iteration yet: nothing trained to score")
    if iteration is None:
        iteration = ran[-1]
    elif iteration not in ran:
        raise WeightsError(f"run {layout.run_id!r} has no iteration {iteration}: it has iterations {ran[0]}-{ran[-1]}")
    updates = [
        (k, policy, step)
        for k in range(iteration, -1, -1)
        for policy in layout.update_policies(k)
        if (step := layout.step(k, StepName.UPDATE.folder(policy))).did_work()
    ]
    if not updates and require_update:
        raise NoUpdateError(
            f"run {layout.run_id!r} has no committed update at or before iteration {iteration}: its weights are the "
            "base model's"
        )
    newest: dict[str, int] = {}
    for k, policy, step in updates:  # the newest update per policy is what serves
        if policy in newest:
            continue
        newest[policy] = k
        if gone := pruned_weights(step.manifest().metadata):
            raise WeightsError(
                f"the weights of {policy} after iteration {k} of run {layout.run_id!r} were removed by `pettingflow "
                f"runs prune` ({gone}); score an iteration whose weights were kept (`pettingflow runs show` lists them)"
            )
    return iteration


def evaluation_config(config: ExperimentConfig, weights: Weights) -> ExperimentConfig:
    """The config an evaluation of ``weights`` runs under.

    A run's weights keep the run's ``WEIGHT_SECTIONS`` (its models, its agents and their prompts, LoRA or not);
    a model is served for every policy; everything else is ``config``'s, so both sides of a comparison ask the
    same tasks with the same seeds."""
    data = config.model_dump(mode="json")
    if weights.kind == "run":
        stored = weights.layout().read_run_info()["config"]
        data.update({key: stored[key] for key in WEIGHT_SECTIONS if key in stored})
    elif weights.kind == "model":
        for policy in data["policies"]:
            policy["model"] = weights.model
    return validate_config(data, source=f"the evaluation of {weights.spec}")


def select_tasks(config: ExperimentConfig, split: str = "validation", num_tasks: int | None = None) -> list[dict]:
    """The first ``num_tasks`` tasks of ``split`` (default ``validation.num_tasks``; 0: all of them).

    ``all``: the held-out tasks, then the train ones. The order fixes each task's position, and so its seeds:
    two evaluations of one split see the same seeds."""
    from pettingflow.envs import load_tasks

    if split not in SPLITS:
        raise WeightsError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    tasks = load_tasks(config.env.dataset, config.env.class_path)
    chosen = {"validation": tasks.validation, "train": tasks.train, "all": [*tasks.validation, *tasks.train]}[split]
    if not chosen:
        raise WeightsError(
            f"the {split} split of {config.env.dataset.source} is empty; choose another --split (all: every task)"
        )
    limit = config.validation.num_tasks if num_tasks is None else num_tasks
    return list(chosen[: limit or None])


def roles_swappable(config: ExperimentConfig) -> bool:
    """Whether ``swap_roles`` applies: two agents with weights of their own (two LoRA adapters, or two policies)."""
    agents = config.agents
    if len(agents) != 2:
        return False
    return config.specialization is Specialization.lora or agents[0].policy != agents[1].policy


def swap_roles(
    config: ExperimentConfig, endpoints: dict[str, PolicyEndpoint]
) -> tuple[ExperimentConfig, dict[str, PolicyEndpoint]]:
    """Each of the two agents served by the other's weights (the positive control of a study): under ``lora`` the
    adapters change hands (the endpoints'), under ``full`` the policies (the config's agents)."""
    agents = config.agents
    names = [a.name for a in agents]
    if not roles_swappable(config):
        raise ValueError(
            "roles_swapped serves each agent with the other's weights, so it needs two agents with weights of their "
            f"own (specialization lora, or full with two policies); this config has {config.specialization.value} "
            f"and agents {[(a.name, a.policy) for a in agents]}"
        )
    if config.specialization is Specialization.lora:
        swapped_names = dict(zip(names, reversed(names), strict=True))
        return config, {
            policy: replace(ep, adapters={agent: ep.adapters[swapped_names.get(agent, agent)] for agent in ep.adapters})
            for policy, ep in endpoints.items()
        }
    swapped = [a.model_copy(update={"policy": b.policy}) for a, b in zip(agents, reversed(agents), strict=True)]
    return config.model_copy(update={"agents": swapped}), endpoints


def same_servers(a: ExperimentConfig, b: ExperimentConfig) -> bool:
    """Whether two evaluations can share one runtime: the same models, specialization and inference settings."""
    keys = ("policies", "specialization", "inference")
    da, db = a.model_dump(mode="json"), b.model_dump(mode="json")
    return all(da[k] == db[k] for k in keys)


@contextlib.contextmanager
def open_runtime(config: ExperimentConfig, run_id: str) -> Iterator[Any]:
    """The servers (managed, or attached with ``inference.url``), Ray and the env cache for an evaluation."""
    from pettingflow.runs.runtime import Runtime

    with Runtime(config, run_id) as runtime:
        yield runtime


def start_evaluation(
    config: ExperimentConfig, config_name: str, overrides: list[str], weights: Weights, extra: dict[str, Any]
) -> RunRef:
    """Create the evaluation run (``eval-<name>-...``: ``runs summary`` skips these) with what it evaluates."""
    run_id = new_run_id(f"eval-{config.run.name}")
    ref, _ = start_or_resume(config, config_name, overrides, run_id, {"evaluates": {**weights.source(), **extra}})
    return ref


def score(
    runtime: Any,
    config: ExperimentConfig,
    ref: RunRef,
    weights: Weights,
    *,
    tasks: list[dict] | None = None,
    reset_servers: bool = False,
    roles_swapped: bool = False,
) -> StepOutcome:
    """Serve ``weights`` in ``runtime`` and run the validation step of the evaluation run ``ref`` on ``tasks``
    (default: the held-out ones).

    ``reset_servers``: first reload every policy's base weights (``PolicyService.serve_base``), because what
    the servers hold is not known here: an attached server may hold anyone's weights, and a runtime shared with
    an earlier evaluation holds that one's (LoRA adapters included)."""
    from pettingflow.steps.rollouts import validation_step

    if reset_servers:
        for service in runtime.services.values():
            service.serve_base()
    if weights.kind == "run":
        runtime.serve_start_of(weights.layout(), int(weights.iteration or 0) + 1)
    endpoints = runtime.endpoints()
    if roles_swapped:
        config, endpoints = swap_roles(config, endpoints)
    ctx = IterationContext(ref.layout(), 0)
    # rows record the version of the weights served (a run's k + 1, the base 0), not this evaluation's iteration
    versions = runtime.served_versions()
    return validation_step(ctx, config, endpoints, env_cache=runtime.env_cache, tasks=tasks, policy_versions=versions)


# ------------------------------------------------------------------------------------------ scores
@dataclass
class AgentScore:
    """One agent's result in one evaluation, every asked episode counted."""

    success_rate: float
    ci95: tuple[float, float]  # over tasks (analysis.stats.success_interval)
    reward_mean: float
    tasks: int
    episodes: int


@dataclass
class EvaluationScores:
    """What an evaluation run scored, read from its committed rows."""

    run_id: str
    weights: str  # the weights' label
    agents: dict[str, AgentScore]
    outcome_agent: str | None  # the agent whose success is the episode's (None: no agent decides it)
    tasks: list[str]  # task ids, in position order
    samples_per_task: int
    temperature: float
    episodes_text: str  # "30 tasks x 2 samples = 60 episodes (...)"
    successes: dict[str, dict[int, list[bool]]] = field(default_factory=dict, repr=False)  # agent -> task -> samples


def read_scores(layout: RunLayout) -> EvaluationScores:
    """Per-agent success with a 95 % interval, from an evaluation run's committed ``iter-0/validation``."""
    from pettingflow.analysis import outcomes
    from pettingflow.analysis.learning import outcome_agent
    from pettingflow.analysis.stats import success_interval
    from pettingflow.analysis.summary import OUTCOME_COLUMNS

    info = layout.read_run_info()
    config = validate_stored_config(info["config"], source=f"{layout.run_uri}/run.json")
    step = layout.step(0, StepName.VALIDATION)
    if not step.is_committed():
        raise FileNotFoundError(f"evaluation run {layout.run_id!r} has no committed validation step (it stopped)")
    metadata = step.manifest().metadata
    request = outcomes.step_request(metadata, config, StepName.VALIDATION)
    if request is None:
        raise FileNotFoundError(f"evaluation run {layout.run_id!r} does not record which tasks it ran")
    rows = read_step_trajectories(step, columns=OUTCOME_COLUMNS).to_pylist()
    asked = outcomes.asked_episodes(*request)
    scores = outcomes.agent_scores(rows, asked)
    try:
        decider: str | None = outcome_agent(config)
    except ValueError:
        decider = None
    agents: dict[str, AgentScore] = {}
    successes: dict[str, dict[int, list[bool]]] = {}
    for agent in [a.name for a in config.agents]:  # an agent with no turn at all (solved before it): 0, counted
        successes[agent] = outcomes.episode_successes(rows, agent, asked)
        interval = success_interval(successes[agent])
        got = scores.get(agent, {"success_rate": 0.0, "reward_mean": 0.0})
        agents[agent] = AgentScore(
            success_rate=got["success_rate"],
            ci95=(interval["ci95_low"], interval["ci95_high"]),
            reward_mean=got["reward_mean"],
            tasks=int(interval["tasks"]),
            episodes=int(interval["episodes"]),
        )
    counted = outcomes.count_episodes(rows, decider or next(iter(agents), ""), *request)
    source = info.get("evaluates") or {}
    return EvaluationScores(
        run_id=layout.run_id,
        weights=_label(source),
        agents=agents,
        outcome_agent=decider,
        tasks=[str(t) for t in metadata.get("tasks", [])],
        samples_per_task=request[1],
        temperature=config.validation.temperature,
        episodes_text=counted.text(),
        successes=successes,
    )


def _label(source: dict[str, Any]) -> str:
    if source.get("weights") == "run":
        return f"{source.get('run_id')} after iteration {source.get('after_iteration')}"
    return str(source.get("model") or BASE)


@dataclass
class Comparison:
    """``a`` minus ``b``, paired task by task on the same tasks and seeds, per agent."""

    a: str  # the weights' labels
    b: str
    a_run: str
    b_run: str
    agents: dict[str, dict[str, float]]  # agent -> paired_bootstrap (delta, ci95_low/high, tasks, better, worse)
    verdict_agent: str
    verdict: str


def compare_evaluations(a: EvaluationScores, b: EvaluationScores) -> Comparison:
    """The paired difference of two evaluations of the same tasks (refused when they ran different tasks, or a
    different number of samples: then there is nothing to pair)."""
    from pettingflow.analysis.stats import paired_bootstrap

    if a.tasks != b.tasks or a.samples_per_task != b.samples_per_task:
        raise WeightsError(
            f"evaluations {a.run_id} and {b.run_id} ran different tasks or samples per task ({len(a.tasks)} x "
            f"{a.samples_per_task} vs {len(b.tasks)} x {b.samples_per_task}): only the same tasks and seeds pair"
        )
    agents = {
        agent: paired_bootstrap(b.successes[agent], a.successes[agent]) for agent in a.agents if agent in b.successes
    }
    if not agents:
        raise WeightsError(f"evaluations {a.run_id} and {b.run_id} share no agent to compare")
    who = a.outcome_agent if a.outcome_agent in agents else next(iter(agents))
    paired = agents[who]
    return Comparison(
        a.weights, b.weights, a.run_id, b.run_id, agents, who,
        verdict(a.weights, b.weights, who, (paired["ci95_low"], paired["ci95_high"])),
    )  # fmt: skip


def verdict(a: str, b: str, agent: str, ci95: tuple[float, float]) -> str:
    """One honest sentence on a paired difference, worded as the run summary words its own
    (``analysis.summary.verdict``): it says plainly when the interval includes 0."""
    low, high = ci95
    if low > 0:
        return f"{agent}'s success is higher with {a} than with {b}; the 95 % interval excludes 0"
    if high < 0:
        return f"{agent}'s success is lower with {a} than with {b}; the 95 % interval excludes 0"
    return (
        f"the 95 % interval includes 0: these tasks cannot tell whether {a} and {b} differ in {agent}'s success "
        "(more tasks, or more samples per task, narrow it)"
    )


# ------------------------------------------------------------------------------------------ report
def score_lines(scores: EvaluationScores) -> list[str]:
    """An evaluation as plain text lines (what ``pettingflow eval`` prints)."""
    out = [
        f"evaluation {scores.run_id} of {scores.weights}: {len(scores.tasks)} tasks x {scores.samples_per_task} "
        f"samples at temperature {scores.temperature:g}"
    ]
    for agent, s in scores.agents.items():
        low, high = s.ci95
        mark = "  (decides the outcome)" if agent == scores.outcome_agent else ""
        out.append(
            f"  {agent}: success {s.success_rate:.1%} (95 % CI [{low:.1%}, {high:.1%}]), reward {s.reward_mean:.3f}, "
            f"{s.episodes} episodes{mark}"
        )
    out.append(f"  episodes: {scores.episodes_text}")
    return out


def comparison_lines(c: Comparison, a: EvaluationScores, b: EvaluationScores) -> list[str]:
    """A comparison as plain text lines: per agent both rates and the paired change, then the verdict."""
    out = [f"{c.a} vs {c.b} ({c.a_run} vs {c.b_run}), paired by task on the same tasks and seeds:"]
    for agent, p in c.agents.items():
        out.append(
            f"  {agent}: {a.agents[agent].success_rate:.1%} vs {b.agents[agent].success_rate:.1%}, change "
            f"{100 * p['delta']:+.1f} pts (95 % CI [{100 * p['ci95_low']:+.1f}, {100 * p['ci95_high']:+.1f}]) over "
            f"{int(p['tasks'])} tasks: {int(p['tasks_better'])} better, {int(p['tasks_worse'])} worse"
        )
    out.append(f"    {c.verdict}")
    return out


def write_report(
    layout: RunLayout,
    scores: EvaluationScores,
    comparison: Comparison | None = None,
    other: EvaluationScores | None = None,
) -> str:
    """``evaluation.json`` and ``evaluation.md`` beside the evaluation run's ``run.json`` (with ``comparison``: the
    paired difference from ``other``, the compared side's scores); returns the markdown's URI."""
    lines = score_lines(scores)
    if comparison is not None and other is not None:
        lines += ["", *comparison_lines(comparison, scores, other)]
    data = {"scores": _plain(scores), "comparison": asdict(comparison) if comparison else None}
    layout.write_run_file(REPORT_JSON, json.dumps(data, indent=2, default=list).encode())
    markdown = f"# Evaluation: {scores.run_id}\n\n```text\n" + "\n".join(lines) + "\n```\n"
    return layout.write_run_file(REPORT_MD, markdown.encode())


def _plain(scores: EvaluationScores) -> dict[str, Any]:
    data = asdict(scores)
    data["successes"] = {a: {str(t): v for t, v in per.items()} for a, per in scores.successes.items()}
    return data


# ------------------------------------------------------------------------------------------ one call
@dataclass
class Evaluated:
    """One scored side: its evaluation run, config and what the step returned."""

    ref: RunRef
    config: ExperimentConfig
    weights: Weights
    outcome: StepOutcome


def evaluate_weights(
    config: ExperimentConfig,
    config_name: str,
    overrides: list[str],
    sides: list[Weights],
    *,
    tasks: list[dict] | None = None,
    extra: dict[str, Any] | None = None,
    reset_attached: bool = True,
    roles_swapped: bool = False,
) -> list[Evaluated]:
    """Score each of ``sides`` on the same tasks and seeds; one evaluation run each.

    Sides whose servers are alike (``same_servers``) share one runtime (one vLLM start), the servers reset to the
    base weights between them; others get a runtime each. ``reset_attached``: reset attached servers before the
    first side too (``pettingflow eval``; the ``learn`` flow resets its shared server itself)."""
    configs = [evaluation_config(config, w) for w in sides]
    if roles_swapped:
        for c in configs:  # refuse a config without two sets of weights before anything starts
            swap_roles(c, {})
    refs = [start_evaluation(c, config_name, overrides, w, extra or {}) for c, w in zip(configs, sides, strict=True)]
    done: list[Evaluated] = []
    i = 0
    while i < len(sides):
        group = [i]
        while group[-1] + 1 < len(sides) and same_servers(configs[i], configs[group[-1] + 1]):
            group.append(group[-1] + 1)
        with open_runtime(configs[i], refs[i].run_id) as runtime:
            for n, j in enumerate(group):
                attached = not all(s.managed for s in runtime.services.values())
                reset = n > 0 or (attached and reset_attached)
                outcome = score(
                    runtime, configs[j], refs[j], sides[j], tasks=tasks, reset_servers=reset,
                    roles_swapped=roles_swapped,
                )  # fmt: skip
                log.info("evaluation %s of %s: %s", refs[j].run_id, sides[j].label(), outcome.metrics.get("agents"))
                done.append(Evaluated(refs[j], configs[j], sides[j], outcome))
        i = group[-1] + 1
    return done
