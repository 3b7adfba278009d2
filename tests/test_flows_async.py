"""Async rollouts (``rollout.async_rollouts``): iteration k+1's rollouts are collected beside iteration k's
update, with the weights k started from. Under random server timing the lag bound holds row by row, the
off-policy rows train against the sampler's log-probs, the report says how much overlapped, and a resumed
run adds nothing. Real Prefect, storage, sandbox and DeepSpeed worker; a scripted LLM (see test_flows.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from test_flows import overrides, scripted  # noqa: F401 (module fixtures)

from pettingflow.configs import load_config
from pettingflow.runs.lineage import weights_before
from pettingflow.storage import RunLayout, read_step_trajectories

ITERATIONS = 3


def task_run_names(flow_run_id) -> list[str]:
    """Task run names of a flow run and its subflows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *[c.id for c in children]]
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": ids}))
            return [tr.name for tr in runs]

    return asyncio.run(read())


@pytest.mark.parametrize("seed", [0])  # one random timing per suite run (each costs ~40 s here)
def test_async_rollouts_keep_the_lag_bound_under_random_timing(tmp_path, prefect_env, tiny_model, scripted, seed):  # noqa: F811
    from pettingflow.flows.train import train

    rng = random.Random(seed)
    scripted.delay = lambda: rng.uniform(0.0, 0.2)  # requests finish in a random order, at random times
    args = overrides(
        tmp_path,
        tiny_model,
        scripted.url,
        f"run.iterations={ITERATIONS}",
        "rollout.async_rollouts=true",
        "validation.frequency=0",
    )
    try:
        state = train("code-env", args, return_state=True)
    finally:
        scripted.delay = None
    assert state.is_completed(), state
    run_id = state.result()["run_id"]
    layout = RunLayout(str(tmp_path), run_id)
    config = load_config("code-env", args)

    for k in range(ITERATIONS):
        rows = read_step_trajectories(layout.step(k, "rollouts"))
        start = weights_before(layout, config, "shared", k).version
        lags = Counter(start - v for v in rows.column("policy_version").to_pylist())
        # iteration 0 is collected before any update; every later one beside the previous update, one version old
        assert lags == Counter({0 if k == 0 else 1: rows.num_rows}), (k, lags)
        batch = layout.step(k, "advantages").read_table("batch-shared.parquet", columns=["policy_lag"])
        assert set(batch.column("policy_lag").to_pylist()) == {0 if k == 0 else 1}  # every trained row says its lag
        update = layout.step(k, "update-shared").manifest().metadata["metrics"]
        batch_rows = layout.step(k, "advantages").manifest().rows
        assert update["policy_lag_max"] == (0 if k == 0 else 1)
        assert update[f"policy_lag/{update['policy_lag_max']}"] == batch_rows
        assert update["behaviour_logprobs"] == ("recomputed" if k == 0 else "sampler")

    for k in range(ITERATIONS - 1):  # the last iteration has no next one to collect
        report = layout.step(k, "report").read_json("metrics.json")
        assert report["async/next_rollouts_s"] > 0
        assert 0 <= report["async/overlap_s"] <= min(report["async/next_rollouts_s"], report["async/update_s"]) + 1e-6
    assert not any(k.startswith("async/") for k in layout.step(ITERATIONS - 1, "report").read_json("metrics.json"))
    names = task_run_names(state.state_details.flow_run_id)
    assert {f"rollouts[iter-{k}, ahead]" for k in range(1, ITERATIONS)} <= set(names)

    # resume: every step is committed; nothing is collected again, no row is added
    before = {k: layout.step(k, "rollouts").manifest().rows for k in range(ITERATIONS)}
    again = train("code-env", args, run_id=run_id, return_state=True)
    assert again.is_completed(), again
    assert {k: layout.step(k, "rollouts").manifest().rows for k in range(ITERATIONS)} == before
    assert not any("ahead" in n for n in task_run_names(again.state_details.flow_run_id))


def test_async_rollouts_refuse_a_paused_server() -> None:
    from pettingflow.configs.loader import ConfigError

    with pytest.raises(ConfigError, match=r"inference\.between_updates.*async_rollouts"):
        load_config("code-env", ["rollout.async_rollouts=true", "inference.between_updates=pause"])
