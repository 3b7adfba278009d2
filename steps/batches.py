"""Steps 2 and 3 of an iteration: filter UID groups, then compute advantages per policy.

Both read committed Parquet and write committed Parquet; neither does RL math itself (that is
``pettingflow.rl``). The advantage step writes one ``batch-<policy>.parquet`` per policy: the
trajectory columns of that policy's kept rows plus an ``advantage`` column, which is exactly what
the update job of that policy reads.

Both steps work on the *training reward* of a row (``training_rewards``): its local ``reward`` mixed with
the episode's team reward (``algorithm.team_reward_weight``) and turned into a return over the agent's
later turns (``algorithm.gamma``), computed from the stored rows every time, so a re-run from ``filtered``
or ``advantages`` with other ``algorithm.*`` values recomputes it. The batch keeps what it used per row:
``team_reward``, ``training_reward`` and ``reward_mix`` (the weights, as JSON).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.faults import maybe_crash
from pettingflow.rl.advantages import compute_advantages
from pettingflow.rl.filters import filter_samples
from pettingflow.rl.rewards import discounted_returns, mix_rewards
from pettingflow.rl.signal import GroupSpread, group_spread, zero_signal_message
from pettingflow.runs.context import IterationContext
from pettingflow.runs.lineage import row_lags, start_version
from pettingflow.steps.outcome import StepOutcome, already_done
from pettingflow.storage import Manifest, read_step_trajectories, write_trajectories
from pettingflow.storage.layout import StepName

BATCH_KIND = b"batch"


def team_rewards(table: pa.Table) -> np.ndarray:
    """Each row's team reward: ``info_json["team_reward"]`` (an env's ``episode_info()``), 0 where absent."""
    out = np.zeros(table.num_rows, dtype=np.float64)
    for i, text in enumerate(table.column("info_json").to_pylist()):
        value = json.loads(text or "{}").get("team_reward")
        if value is not None:
            out[i] = float(value)
    return out


def _has_team_reward(table: pa.Table) -> bool:
    return any('"team_reward"' in (text or "") for text in table.column("info_json").to_pylist())


def _column(table: pa.Table, name: str, default: Any) -> list[Any]:
    """A column as a list; ``default`` per row when the table predates it (files read without the project)."""
    return table.column(name).to_pylist() if name in table.column_names else [default] * table.num_rows


def reward_mix(config: ExperimentConfig) -> dict[str, float]:
    """The weights of the training reward, as stored per row of a batch (``reward_mix``)."""
    return {"team_reward_weight": config.algorithm.team_reward_weight, "gamma": config.algorithm.gamma}


def training_rewards(table: pa.Table, config: ExperimentConfig, episodes: pa.Table | None = None) -> np.ndarray:
    """The reward each row of ``table`` trains on (docs/rl.md, "Multi-level rewards").

    ``m = reward + alpha * team_reward`` per row, then ``G = m + gamma * G(the agent's next turn on the path)``.
    Returns need the episodes' other rows: ``episodes`` holds every row of them (the iteration's rollouts),
    ``table`` may be a filtered subset; None: ``table`` itself is complete. With ``alpha = gamma = 0`` this is
    the ``reward`` column unchanged.
    """
    algo = config.algorithm
    local = np.asarray(table.column("reward").to_numpy(zero_copy_only=False), dtype=np.float64)
    if algo.team_reward_weight == 0.0 and algo.gamma == 0.0:
        return local
    source = episodes if (episodes is not None and algo.gamma > 0.0) else table
    if algo.team_reward_weight > 0.0 and source.num_rows and not _has_team_reward(source):
        raise ValueError(
            f"algorithm.team_reward_weight={algo.team_reward_weight} but no row reports a team reward "
            "(info_json team_reward, from the env's episode_info()): this env has none, or the rollouts predate it; "
            "set algorithm.team_reward_weight=0"
        )
    mixed = mix_rewards(
        source.column("reward").to_numpy(zero_copy_only=False), team_rewards(source), algo.team_reward_weight
    )
    iterations, rollouts = _column(source, "iteration", 0), _column(source, "rollout_idx", 0)
    returns = discounted_returns(
        mixed,
        list(zip(iterations, rollouts, strict=True)),
        _column(source, "agent_idx", 0),
        _column(source, "turn_idx", 0),
        _column(source, "continued", True),
        algo.gamma,
    )
    if source is table:
        return returns

    def keys(t: pa.Table) -> list[tuple[Any, ...]]:
        cols = [_column(t, c, d) for c, d in (("iteration", 0), ("rollout_idx", 0), ("turn_idx", 0))]
        cols += [_column(t, "agent_idx", 0), _column(t, "branch_idx", 0)]
        return list(zip(*cols, strict=True))

    by_key = dict(zip(keys(source), returns, strict=True))
    missing = [k for k in keys(table) if k not in by_key]
    if missing:
        raise ValueError(
            f"{len(missing)} rows are not among the episodes' rows, e.g. (iteration, rollout, turn, "
            f"agent, branch) = {missing[0]}; pass the iteration's rollouts as episodes"
        )
    return np.asarray([by_key[k] for k in keys(table)], dtype=np.float64)


def filter_table(table: pa.Table, config: ExperimentConfig) -> tuple[pa.Table, dict[str, Any]]:
    """The rows the configured filter keeps (none/mean/std/dapo/uid, as in PettingLLMs' trainer), and what it removed.

    ``table`` holds whole episodes (the rollouts step): the filter sees each row's training reward."""
    algo = config.algorithm
    result = filter_samples(
        table.column("uid").to_pylist(),
        training_rewards(table, config),
        algo.filter_method,
        algo.filter_ratio,
    )
    kept = table.filter(pa.array(result.keep, pa.bool_()))
    metrics = {
        "method": algo.filter_method,
        "ratio": algo.filter_ratio,
        "rows_in": table.num_rows,
        "rows_kept": kept.num_rows,
        "removed_samples": result.removed_samples,
        "removed_groups": len(result.removed_uids),
        "reason": result.reason,
        **reward_mix(config),
    }
    return kept, metrics


def with_advantages(table: pa.Table, config: ExperimentConfig, episodes: pa.Table | None = None) -> pa.Table:
    """``table`` plus the reward it trains on and a float32 ``advantage`` column (group-relative within UIDs).

    Added columns: ``team_reward`` (float32), ``training_reward`` (float32, what the advantages are computed
    from), ``reward_mix`` (JSON of ``team_reward_weight`` and ``gamma``), ``advantage``. ``episodes``: every
    row of the episodes (the iteration's rollouts) when ``table`` is a filtered subset; see ``training_rewards``.
    """
    rewards = training_rewards(table, config, episodes)
    advantages = compute_advantages(rewards, table.column("uid").to_pylist(), config.algorithm.advantage_estimator)
    mix = json.dumps(reward_mix(config), sort_keys=True)
    table = table.append_column("team_reward", pa.array(team_rewards(table).astype(np.float32), pa.float32()))
    table = table.append_column("training_reward", pa.array(rewards.astype(np.float32), pa.float32()))
    table = table.append_column("reward_mix", pa.array([mix] * table.num_rows, pa.string()))
    return table.append_column("advantage", pa.array(advantages.astype(np.float32), pa.float32()))


def policy_batch(table: pa.Table, policy: str) -> pa.Table:
    """The rows of one policy, marked as a batch in the Parquet metadata."""
    part = table.filter(pc.equal(table.column("policy_name"), policy))
    return part.replace_schema_metadata({**(part.schema.metadata or {}), b"pettingflow.kind": BATCH_KIND})


def filter_step(ctx: IterationContext, config: ExperimentConfig) -> StepOutcome:
    """Apply the configured filter to the iteration's rollouts; commit the kept rows."""
    out = ctx.step(StepName.FILTERED)
    if done := already_done(out):
        return done
    kept, metrics = filter_table(read_step_trajectories(ctx.step(StepName.ROLLOUTS)), config)
    manifest = write_trajectories(out, kept, metadata=metrics)
    return StepOutcome(StepName.FILTERED, out.uri, manifest.rows, False, metrics)


def advantage_step(ctx: IterationContext, config: ExperimentConfig) -> StepOutcome:
    """GRPO-style advantages within UID groups, written as one batch file per policy."""
    out = ctx.step(StepName.ADVANTAGES)
    if done := already_done(out):
        return done
    # every row of the episodes: returns (gamma > 0) need the ones the filter removed, and so does the check
    # that the batch carries a learning signal (how the groups' rewards differed before the filter)
    rollouts = read_step_trajectories(ctx.step(StepName.ROLLOUTS))
    episodes = rollouts if config.algorithm.gamma > 0 else None
    table = with_advantages(read_step_trajectories(ctx.step(StepName.FILTERED)), config, episodes)
    signal = learning_signal(rollouts, config)
    policies = [p.name for p in config.policies]
    metrics: dict[str, Any] = {
        "estimator": config.algorithm.advantage_estimator,
        **reward_mix(config),
        "policies": {},
    }
    out.begin()
    maybe_crash("advantages:mid", out.path)  # kill matrix
    for policy in policies:
        part = policy_batch(table, policy)
        # the lag each row will be trained at: versions between its sampler's weights and the update's start
        start = start_version(ctx.layout, policy, ctx.iteration)
        lag = row_lags(part.column("policy_version").to_numpy(zero_copy_only=False), start)
        part = part.append_column("policy_lag", pa.array(lag, pa.int32()))
        out.write_table(batch_file(policy), part)
        adv = part.column("advantage").to_numpy() if part.num_rows else np.zeros(0)
        metrics["policies"][policy] = {
            "rows": part.num_rows,
            "policy_lag_max": int(lag.max()) if len(lag) else 0,
            "advantage_mean": float(adv.mean()) if len(adv) else 0.0,
            "advantage_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
            "nonzero_advantage_rows": int((adv != 0).sum()),
        }
        before = signal.get(policy)
        if before is not None:
            spread, rows_before = before
            metrics["policies"][policy].update({"groups": spread.groups, "groups_varied": spread.varied})
            if not (adv != 0).any():
                metrics["policies"][policy]["zero_signal"] = True
                metrics["policies"][policy]["signal_message"] = zero_signal_message(
                    policy,
                    spread,
                    rows_before,
                    part.num_rows,
                    config.algorithm.filter_method,
                    config.advantage_group_setting,
                )
    manifest: Manifest = out.commit(metrics)
    return StepOutcome(StepName.ADVANTAGES, out.uri, manifest.rows, False, metrics)


def learning_signal(rollouts: pa.Table, config: ExperimentConfig) -> dict[str, tuple[GroupSpread, int]]:
    """Per trained policy: how its UID groups' training rewards differed before the filter, and its row count.

    Policies with no rows are left out (an L3 config whose agents use some policies only)."""
    rewards = training_rewards(rollouts, config)
    names = rollouts.column("policy_name").to_pylist()
    uids = rollouts.column("uid").to_pylist()
    out = {}
    for policy in dict.fromkeys(names):
        idx = [i for i, name in enumerate(names) if name == policy]
        out[policy] = (group_spread([uids[i] for i in idx], rewards[idx]), len(idx))
    return out


def zero_signal_policies(advantage_metrics: dict[str, Any]) -> dict[str, str]:
    """policy -> the warning, for every policy the advantages step found without a learning signal."""
    return {
        policy: values["signal_message"]
        for policy, values in (advantage_metrics.get("policies") or {}).items()
        if values.get("zero_signal")
    }


def batch_file(policy: str) -> str:
    """File name of a policy's batch inside the ``advantages`` step."""
    return f"batch-{policy}.parquet"
