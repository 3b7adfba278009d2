"""``pettingflow export``: a run's trained team as Hugging Face folders with model cards, to hand on and load.

One folder per policy (``<out>/<policy>/``: full weights, tokenizer, generation config, ``README.md``), or under
LoRA one per agent (``<out>/<policy>-<agent>/``: that agent's adapter, or with ``merge_lora`` the base model with
the adapter merged in, a full model). ``team.json`` says which folder plays which agent. The card (the Hugging
Face convention for a trained model) records how the weights were made: the base model, the config as YAML, the
task source, the iterations, the tokens generated, held-out success before -> after with its interval
(``analysis.summary``), and the team.

Why refuse rather than fall back: a run with no committed update holds no trained weights, and weights removed
by ``runs prune`` are gone; exporting the base model under the run's name would hand on something untrained.
The export is written into a temporary sibling folder and renamed into place at the end, so an interrupted
export never leaves a half-written folder under ``out``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pettingflow.configs.loader import validate_stored_config
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.runs.evaluation import NoUpdateError, WeightsError, run_iteration
from pettingflow.runs.lineage import PolicyWeights, base_model_dir, weights_in_step
from pettingflow.storage import RunLayout
from pettingflow.storage.layout import StepName

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEAM_FILE = "team.json"


class ExportError(ValueError):
    """An export that cannot be made; the message says, in one line, what was wrong and what to ask instead."""


@dataclass
class ExportedFolder:
    """One folder of the export: which policy (and agent, under LoRA), what it holds, where its weights came from."""

    folder: str  # its name under ``out``
    policy: str
    agents: list[str]  # the agents these weights play
    holds: str  # "full weights", "LoRA adapter", "LoRA merged into the base", "base weights (not trained)"
    source: str  # the update step they come from, or "base"
    version: int  # 0 = base, k + 1 = after iteration k


@dataclass
class Export:
    run_id: str
    iteration: int
    out: str
    folders: list[ExportedFolder] = field(default_factory=list)


def export_run(layout: RunLayout, out: str | Path, iteration: int | None = None, merge_lora: bool = False) -> Export:
    """Write the team's weights after ``iteration`` (default: the run's last) under ``out``; returns what went
    where. ``ExportError`` (one line) for a run that does not exist, has no committed update, a missing or pruned
    iteration, or an ``out`` that already holds files."""
    try:
        info = layout.read_run_info()
    except FileNotFoundError:
        raise ExportError(
            f"no run {layout.run_id!r} under {layout.root} (`pettingflow runs list` shows runs)"
        ) from None
    config = validate_stored_config(info["config"], source=f"{layout.run_uri}/run.json")
    try:
        k = run_iteration(layout, iteration)
    except NoUpdateError as exc:
        raise ExportError(f"{exc}: nothing trained to export") from None
    except WeightsError as exc:
        raise ExportError(str(exc)) from None
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--out {target} already exists and is not empty: give a new folder or remove it")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    export = Export(layout.run_id, k, str(target))
    try:
        for policy in dict.fromkeys(a.policy for a in config.agents):
            weights = trained_weights(layout, config, policy, k)
            export.folders += _export_policy(tmp, config, weights, merge_lora)
        card = ModelCard(layout, info, config, k, export)
        for entry in export.folders:
            (tmp / entry.folder / "README.md").write_text(card.text(entry))
        team = {a.name: _team_entry(a, export) for a in config.agents}
        (tmp / TEAM_FILE).write_text(json.dumps({"run_id": layout.run_id, "iteration": k, "agents": team}, indent=2))
        for path in tmp.rglob("*"):  # handed on: the run's weight files are private (0600), their copies are not
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            target.rmdir()  # empty (checked above)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return export


def trained_weights(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> PolicyWeights:
    """``policy``'s weights after ``iteration``: its newest update that changed weights, else its base model."""
    base = base_model_dir(config, policy)
    for k in range(iteration, -1, -1):
        step = layout.step(k, StepName.UPDATE.folder(policy))
        if step.did_work():
            return weights_in_step(step, policy, base, version=k + 1)
    return PolicyWeights(policy=policy, base_dir=base, model_dir=base)


def _export_policy(
    tmp: Path, config: ExperimentConfig, weights: PolicyWeights, merge_lora: bool
) -> list[ExportedFolder]:
    """The folder(s) of one policy: full weights, or under LoRA one per agent (adapter, or merged)."""
    agents = [a.name for a in config.agents_of(weights.policy)]
    if config.specialization is not Specialization.lora:
        folder = tmp / weights.policy
        _copy_model(Path(weights.model_dir), folder)
        _complete(folder, Path(weights.base_dir))
        holds = "full weights" if weights.version else "base weights (not trained)"
        return [ExportedFolder(weights.policy, weights.policy, agents, holds, weights.source, weights.version)]
    out = []
    for agent in agents:
        name = f"{weights.policy}-{agent}"
        adapter = weights.adapters.get(agent)
        if adapter is None:  # this agent's adapter was never trained: its weights are the base model's
            _copy_model(Path(weights.base_dir), tmp / name)
            holds, source, version = "base weights (not trained)", "base", 0
        elif merge_lora:
            merge_adapter(Path(weights.base_dir), Path(adapter), tmp / name)
            holds, source, version = "LoRA merged into the base", weights.source, weights.version
        else:
            shutil.copytree(adapter, tmp / name)
            holds, source, version = "LoRA adapter", weights.source, weights.version
        _complete(tmp / name, Path(weights.base_dir))
        out.append(ExportedFolder(name, weights.policy, [agent], holds, source, version))
    return out


def _copy_model(source: Path, folder: Path) -> None:
    """A model folder's files (weights, config, tokenizer), without PettingFlow's own markers."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns(".pettingflow-*", "_COMMITTED.json"))


def merge_adapter(base: Path, adapter: Path, folder: Path) -> None:
    """The base model with a LoRA adapter merged in (peft's ``merge_and_unload``), saved as a full model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", local_files_only=True)
    merged = PeftModel.from_pretrained(model, adapter, local_files_only=True).merge_and_unload()
    merged.save_pretrained(folder)


def _complete(folder: Path, base: Path) -> None:
    """Add what a loader needs and the weights' folder may lack: the tokenizer and the generation config (both the
    base model's: training changes neither)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if not all((folder / f).is_file() for f in TOKENIZER_FILES):
        AutoTokenizer.from_pretrained(base, local_files_only=True).save_pretrained(folder)
    if not (folder / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(base, local_files_only=True)
        except OSError:  # the base has none: the defaults its config implies
            generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(base, local_files_only=True))
        generation.save_pretrained(folder)


def _team_entry(agent: Any, export: Export) -> dict[str, Any]:
    folder = next(f for f in export.folders if agent.name in f.agents)
    return {"class_path": agent.class_path, "policy": agent.policy, "folder": folder.folder, "holds": folder.holds}


# ------------------------------------------------------------------------------------------ the model card
class ModelCard:
    """The README.md of each exported folder: what it is and how it was trained, from the run's stored files."""

    def __init__(
        self, layout: RunLayout, info: dict[str, Any], config: ExperimentConfig, iteration: int, export: Export
    ):
        from pettingflow.analysis.summary import _heldout, summarize_run

        self.layout, self.info, self.config, self.iteration, self.export = layout, info, config, iteration, export
        summary = summarize_run(layout)
        self.tokens = sum(line.tokens for line in summary.iterations if line.iteration <= iteration)
        # held-out before -> after as the run summary computes it, over the iterations up to the exported one
        self.heldout, self.heldout_missing = _heldout(
            layout, [line.iteration for line in summary.iterations if line.iteration <= iteration], config
        )

    def text(self, entry: ExportedFolder) -> str:
        cfg = self.config
        base = cfg.policy(entry.policy).model
        front = {
            "base_model": base,
            "library_name": "peft" if entry.holds == "LoRA adapter" else "transformers",
            "tags": ["pettingflow", "reinforcement-learning", "grpo", "multi-agent"],
        }
        data = cfg.env.dataset
        source = data.source + (f" ({data.path})" if data.path else "")
        lines = [
            "---",
            yaml.safe_dump(front, sort_keys=False).strip(),
            "---",
            "",
            f"# {entry.folder}: run {self.layout.run_id} after iteration {self.iteration}",
            "",
            f"{entry.holds.capitalize()} of policy `{entry.policy}`, trained with PettingFlow (multi-agent, multi-turn "
            "RL; GRPO-style group advantages). Load it with "
            + (
                "peft (`PeftModel.from_pretrained(base, folder)`) on the base model below."
                if entry.holds == "LoRA adapter"
                else "transformers (`AutoModelForCausalLM.from_pretrained(folder)`) or serve it with vLLM."
            ),
            "",
            "## Training",
            "",
            f"- base model: `{base}`",
            f"- config: `{self.info.get('config_name')}` with overrides `{self.info.get('overrides', [])}`"
            " (resolved below)",
            f"- tasks: env `{cfg.env.class_path}`, source {source}, held-out share {data.validation_fraction} "
            f"(split seed {data.split_seed})",
            f"- iterations: {self.iteration + 1} of {cfg.run.iterations} planned (0-{self.iteration}); these weights: "
            + (f"version {entry.version}, from `{entry.source}`" if entry.version else "the base model's (no update)"),
            f"- tokens generated in training (iterations 0-{self.iteration}): {self.tokens:,}",
            f"- specialization: {cfg.specialization.value}",
            "",
            "## Held-out success",
            "",
            self._heldout_line(),
            "",
            "## The team",
            "",
            "| agent | class | policy | its weights in this export |",
            "| --- | --- | --- | --- |",
        ]
        for agent in cfg.agents:
            folder = next(f for f in self.export.folders if agent.name in f.agents)
            lines.append(
                f"| {agent.name} | `{agent.class_path}` | {agent.policy} | `{folder.folder}/` ({folder.holds}) |"
            )
        lines += ["", "## Config", "", "```yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).strip()]
        return "\n".join([*lines, "```", ""])

    def _heldout_line(self) -> str:
        held = self.heldout
        if held is None:
            return f"Not measured ({self.heldout_missing})."
        low, high = held.ci95
        return (
            f"{held.agent} (decides the outcome), {held.tasks} held-out tasks, {held.episodes} episodes: "
            f"{held.before:.1%} before training -> {held.after:.1%} after iteration {held.after_iteration}, change "
            f"{100 * held.delta:+.1f} pts (95 % CI [{100 * low:+.1f}, {100 * high:+.1f}], paired by task)."
        )


def export_json(export: Export) -> str:
    """What ``export_run`` wrote, as JSON (for tools and tests)."""
    return json.dumps(asdict(export), indent=2)
