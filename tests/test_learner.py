"""The resident learner: ranks in Ray actors keep the model and Adam moments across updates; a killed learner
restarts from the newest committed checkpoint and says how old its optimizer state is.

Tiny random Llama, bf16 + ZeRO-0 (the shipped configs' engine: DeepSpeed's BF16_Optimizer with fp32 master
weights), one thread per rank.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import test_training_worker
import torch
from safetensors.torch import load_file
from test_training_worker import load_model, make_rows, spec_for, write_batch

from pettingflow.runs.replay import verify_replay
from pettingflow.training import UpdateError
from pettingflow.training.checkpoint import BASE_WEIGHTS
from pettingflow.training.launch import UpdateSpec

tiny_model_dir = test_training_worker.tiny_model_dir  # the same session fixture (one tiny model per test run)
in_process = test_training_worker.in_process

TRAIN = {"dtype": "bf16", "zero_stage": 0, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "lr": 1e-2}


def batches(tmp: Path, n: int) -> list[str]:
    """``n`` different batches of 4 rows (one optimizer step each: 2 micro-batches of 2)."""
    out = []
    for k in range(n):
        rows = make_rows(4, seed=10 + k)
        out.append(write_batch(tmp / f"batch-{k}.parquet", rows, [1.0, -1.0, 0.5, -0.5]))
    return out


def chain_spec(batch: str, out: Path, init: Path, k: int, prev: dict | None, **kw) -> UpdateSpec:
    """Update k of a chain: starts from update k-1's outputs (named v<k-1>), produces v<k>."""
    start_dir = Path(prev["outputs"]["model"]) if prev else init
    return spec_for(
        batch,
        out,
        start_dir,
        training=TRAIN,
        base_model_dir=str(init),
        start_weights=f"v{k - 1}" if prev else BASE_WEIGHTS,
        weights_uri=f"v{k}",
        resume_dir=kw.pop("resume_dir", None),
        save_resume_state=kw.pop("save_resume_state", True),
        seed=k,
        **kw,
    )


def safetensors_of(metrics: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(metrics["outputs"]["model"]) / "model.safetensors"))


@pytest.mark.slow
def test_resident_updates_equal_updates_with_a_kill_and_resume(local_ray, tiny_model_dir, tmp_path):
    from pettingflow.allocator import describe
    from pettingflow.training.learner import Learner, rank_cache_env

    data = batches(tmp_path, 3)

    # A: three updates on one resident learner
    a = Learner("shared", 1, tmp_path / "logs-a", master_host="127.0.0.1").start()
    ma: list[dict] = []
    try:
        for k in range(3):
            ma.append(a.update(chain_spec(data[k], tmp_path / f"a{k}", tiny_model_dir, k, ma[-1] if ma else None)))
            if k == 0:
                steps_after_first = {float(s["step"]) for s in a.call("optimizer_state")["state"].values()}
        state_a = a.call("state_summary")
        opt_a = a.call("optimizer_state")
    finally:
        a.stop()
    assert [m["optimizer_state"] for m in ma] == ["new", "resident", "resident"]
    assert [m["learner_loaded"] for m in ma] == [True, False, False]
    assert a.starts == 1 and state_a["holds"] == "v2" and state_a["updates_done"] == 3
    # the ranks run with the allocator the default (auto) resolves to here: tcmalloc when installed
    assert state_a["malloc"] == describe("auto")
    # and with oneDNN's primitive caches bounded (training/learner.py, RANK_CACHE_ENV)
    assert state_a["cache_env"] == rank_cache_env() and rank_cache_env()["LRU_CACHE_CAPACITY"]
    # Adam was not reset between updates: its step count went on by one per update
    steps = {float(s["step"]) for s in opt_a["state"].values()}
    assert len(steps_after_first) == 1 and steps == {steps_after_first.pop() + 2} and state_a["global_steps"] == 3
    # the first window's old log-probs came from the training forward itself (one epoch): no extra pass
    assert all(m["old_logprob_forwards_skipped"] == 2 for m in ma)
    assert (tmp_path / "a2" / "worker.log").read_text().count("rank0") > 0

    # B: two updates, kill -9 the rank, the next update fails with the log tail, the retry restores exactly
    b = Learner("shared", 1, tmp_path / "logs-b", master_host="127.0.0.1").start()
    mb: list[dict] = []
    try:
        for k in range(2):
            mb.append(b.update(chain_spec(data[k], tmp_path / f"b{k}", tiny_model_dir, k, mb[-1] if mb else None)))
        os.kill(b.pids[0], signal.SIGKILL)
        spec2 = chain_spec(
            data[2], tmp_path / "b2", tiny_model_dir, 2, mb[-1], resume_dir=mb[-1]["outputs"]["deepspeed"]
        )
        with pytest.raises(UpdateError, match="resident learner") as info:
            b.update(spec2)
        assert "learner-shared-rank0.log" in str(info.value) and not b.alive
        assert "lost rank: rank 0 on node" in str(info.value) and "its process died" in str(info.value)
        m2 = b.update(spec2)  # what the Prefect task's retry does
        opt_b = b.call("optimizer_state")
    finally:
        b.stop()
    assert b.starts == 2 and m2["learner_loaded"] and m2["optimizer_state"] == "restored"
    assert m2["learner"]["started_for_this_update"] is True
    wa, wb = safetensors_of(ma[2]), safetensors_of(m2)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], safetensors_of(ma[1])[k]) for k in wa)  # the last update changed weights
    for i, state in opt_a["state"].items():
        for key, value in state.items():
            assert torch.allclose(value, opt_b["state"][i][key], rtol=0, atol=1e-7), (i, key)


@pytest.mark.slow
def test_a_failing_update_reports_the_log_tail_and_the_next_one_restarts(local_ray, tiny_model_dir, tmp_path):
    from pettingflow.training.learner import Learner

    rows = make_rows(2)
    for r in rows:
        r["policy_name"] = "other"
    bad = write_batch(tmp_path / "bad.parquet", rows, [1.0, -1.0])
    learner = Learner("shared", 1, tmp_path / "logs", master_host="127.0.0.1").start()
    try:
        with pytest.raises(UpdateError, match="holds rows of policies") as info:
            learner.update(chain_spec(bad, tmp_path / "bad", tiny_model_dir, 0, None))
        assert "--- " in str(info.value) and not learner.alive
        good = batches(tmp_path, 1)[0]
        m = learner.update(chain_spec(good, tmp_path / "good", tiny_model_dir, 0, None))
    finally:
        learner.stop()
    assert learner.starts == 2 and m["skipped"] is False and m["optimizer_state"] == "new"


def test_stale_snapshot_keeps_its_moments_and_the_newer_weights(tiny_model_dir, tmp_path, in_process):
    """A restart whose newest snapshot is one update older than the weights: weights = the newer checkpoint,
    moments = the snapshot's, and the metrics say 'stale', age 1."""
    from pettingflow.training.worker import UpdateWorker

    data = batches(tmp_path, 3)
    m0 = in_process(chain_spec(data[0], tmp_path / "u0", tiny_model_dir, 0, None))
    m1 = in_process(chain_spec(data[1], tmp_path / "u1", tiny_model_dir, 1, m0, save_resume_state=False))
    assert m0["outputs"]["deepspeed"] and m1["outputs"]["deepspeed"] is None and m1["optimizer_state"] == "reset"

    spec = chain_spec(
        data[2], tmp_path / "u2", tiny_model_dir, 2, m1, resume_dir=m0["outputs"]["deepspeed"], optimizer_age=1
    )
    worker = UpdateWorker()
    try:
        worker._begin(spec)
        worker.read_rows()
        status = worker.prepare()
        assert status == {"learner_loaded": True, "optimizer_state": "stale", "optimizer_age": 1}
        want = load_model(Path(m1["outputs"]["model"]), torch.bfloat16).state_dict()
        got = worker.engine.module.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        # the fp32 master weights follow the newer weights too (else the next step would jump back to v0)
        opt = worker.engine.optimizer  # bf16 + ZeRO-0: DeepSpeed's FP16_UnfusedOptimizer, fp32 master per param
        pairs = [
            (m, p) for mg, pg in zip(opt.fp32_groups, opt.fp16_groups, strict=True) for m, p in zip(mg, pg, strict=True)
        ]
        assert pairs and all(torch.equal(master, param.detach().float()) for master, param in pairs)
        # the snapshot's Adam moments (a fresh optimizer's are all zero)
        state = list(worker.engine.optimizer.optimizer.state.values())
        assert state and all(float(s["exp_avg"].abs().sum()) > 0 for s in state)
    finally:
        worker.cleanup()


def uneven_batches(tmp: Path, n: int) -> list[str]:
    """``n`` batches of 7 rows of different lengths (mini-batches of 4 + 3: uneven over 2 ranks)."""
    return [
        write_batch(tmp / f"uneven-{k}.parquet", make_rows(7, seed=20 + k), [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25])
        for k in range(n)
    ]


def run_chain(
    tmp: Path,
    name: str,
    data: list[str],
    init: Path,
    ranks: int,
    training: dict,
    first: int = 0,
    prev: dict | None = None,
) -> tuple[list, dict]:
    """``len(data)`` updates of one resident learner with ``ranks`` ranks; its metrics and final rank state
    (Adam's state after the third update too). ``first``/``prev``: go on from update ``prev`` of another
    learner, restoring its optimizer snapshot."""
    from pettingflow.training.learner import Learner

    learner = Learner("shared", ranks, tmp / f"logs-{name}", master_host="127.0.0.1").start()
    metrics: list[dict] = []
    state: dict = {}
    try:
        for k, batch in enumerate(data, start=first):
            prev = metrics[-1] if metrics else prev
            resume = {"resume_dir": prev["outputs"]["deepspeed"]} if prev and not metrics else {}
            spec = chain_spec(batch, tmp / f"{name}{k}", init, k, prev, **resume)
            settings = spec.training.model_validate(spec.training.model_dump() | training | {"num_processes": ranks})
            spec = spec.model_copy(update={"training": settings})
            metrics.append(learner.update(spec))
            if k == 2 and training.get("zero_stage") == 0:
                state["after3"] = learner.call("optimizer_state")["state"]
        state |= {
            "summary": learner.call("state_summary"),
            "optimizer": learner.call("optimizer_state") if training.get("zero_stage") == 0 else None,
            "params": learner.call_all("full_parameters")[0],
        }
    finally:
        learner.stop()
    return metrics, state


def update_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """``|a - b| / |b - start|`` over all weights: how far apart two runs' weights are, as a fraction of how far
    the updates moved them (Adam's per-element normalisation turns float-rounding differences of near-zero
    gradients into visible element differences, so a max-abs tolerance says little; 2 ranks against 1 under
    the old plan were 0.57 apart)."""
    assert a.keys() == b.keys() == start.keys()
    apart = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
    moved = sum(float((b[k] - start[k]).double().pow(2).sum()) for k in b) ** 0.5
    assert moved > 0, "the update did not move the weights"
    return apart / moved


@pytest.mark.slow
def test_world_size_changes_speed_never_the_updates(local_ray, tiny_model_dir, tmp_path):
    """The same 3 committed batches on a resident learner at 1 rank and at 2 ranks (ZeRO-0, fp32): the same
    optimizer steps, the same weights after every update and the same Adam step count and moments at the end, to
    fp32 rounding. A run that goes on at 2 ranks after 3 updates at 1 restores the 1-rank optimizer snapshot and
    makes the 1-rank 4th update (Adam's step count goes on: 8). 2 ranks with ZeRO-3, gradient checkpointing and
    the LM head in chunks of 3 tokens for 2 updates give the same weights and losses again; ZeRO-1, ZeRO-2 +
    optimizer offload (the LM head in chunks) and ZeRO-3 + optimizer and parameter offload (the head at once at the
    loss positions; ZeRO-1: the model's own logits) give the same first update; the HF checkpoint
    written from the gathered ZeRO-3 shards loads in transformers and equals the learner's parameters. A new
    2-rank learner that restores the snapshot of the second update makes the third again bitwise (an exact
    replay, ``runs/replay.py``)."""
    data = uneven_batches(tmp_path, 4)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    fp32 = {"dtype": "fp32", "micro_batch_size": 1, "mini_batch_size": 4, "gradient_accumulation_steps": 1}
    one, one_state = run_chain(tmp_path, "one", data, tiny_model_dir, 1, fp32 | {"zero_stage": 0})
    one_state["optimizer"] = {"state": one_state.pop("after3")}
    two, two_state = run_chain(tmp_path, "two", data[:3], tiny_model_dir, 2, fp32 | {"zero_stage": 0})
    # a replay at 2 ranks: a new learner restoring the snapshot of update 2 makes update 3 again, bitwise
    (replay,), _ = run_chain(tmp_path, "replay", data[2:3], tiny_model_dir, 2, fp32 | {"zero_stage": 0}, 2, two[1])
    assert (two[2]["optimizer_state"], replay["optimizer_state"]) == ("resident", "restored")
    assert verify_replay(two[2], replay, []) is None and replay["loss"] == two[2]["loss"]
    want, got = safetensors_of(two[2]), safetensors_of(replay)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # a run that goes on at 2 ranks after 3 updates at 1: its 4th update restores the 1-rank snapshot
    resumed = run_chain(tmp_path, "more", data[3:], tiny_model_dir, 2, fp32 | {"zero_stage": 0}, first=3, prev=one[2])[
        0
    ][0]
    assert resumed["optimizer_state"] == "restored" and resumed["global_step"] == one[3]["global_step"] == 8
    assert update_distance(safetensors_of(one[3]), safetensors_of(resumed), safetensors_of(one[2])) < 1e-4
    one = one[:3]
    z3 = fp32 | {"zero_stage": 3, "gradient_checkpointing": True, "head_chunk_tokens": 3}
    three, three_state = run_chain(tmp_path, "z3", data[:2], tiny_model_dir, 2, z3)

    assert [m["num_processes"] for m in one + two] == [1] * 3 + [2] * 3
    assert [m["optimizer_steps"] for m in one] == [m["optimizer_steps"] for m in two] == [2, 2, 2]
    assert [m["optimizer_state"] for m in two] == ["new", "resident", "resident"]
    assert one[2]["global_step"] == two_state["summary"]["global_steps"] == 6
    # loss and gradient norm (Adam's weights hide a uniform gradient scale such as a sum over ranks; the norm does
    # not): fp32 sums in another order, within the 2-rank test's 1e-5 relative
    print("\ngrad_norm 1 rank vs 2:", [(m1["grad_norm"], m2["grad_norm"]) for m1, m2 in zip(one, two, strict=True)])
    for m1, m2 in zip(one, two, strict=True):
        assert m2["model_tokens"] == m1["model_tokens"] and m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert update_distance(safetensors_of(m1), safetensors_of(m2), start) < 1e-4
    opt1, opt2 = one_state["optimizer"]["state"], two_state["optimizer"]["state"]
    assert opt1.keys() == opt2.keys() and opt1
    for i, state in opt1.items():
        assert float(state["step"]) == float(opt2[i]["step"]) == 6
        for key in ("exp_avg", "exp_avg_sq"):
            # fp32 sums in another order: differences relative to the moment's scale, not elementwise
            diff = float((state[key] - opt2[i][key]).abs().max())
            assert diff <= 1e-4 * float(state[key].abs().max()), (i, key, diff)

    # ZeRO-3 + gradient checkpointing at 2 ranks = ZeRO-0 at 1 rank
    for m1, m3 in zip(one[:2], three, strict=True):
        assert m3["zero_stage"] == 3 and m3["optimizer_steps"] == m1["optimizer_steps"]
        assert m3["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m3["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert update_distance(safetensors_of(m1), safetensors_of(m3), start) < 1e-4
    # the other ZeRO stages and offload at 2 ranks, one update each
    for name, extra in {
        "z1": {"zero_stage": 1, "head_at_loss_positions": False},  # the model's own logits, not the head alone
        # the head in chunks, a filler micro-batch (0 tokens: one empty chunk) and DeepSpeed's backward hooks
        "z2-offload": {"zero_stage": 2, "offload_optimizer": True, "head_chunk_tokens": 3},
        "z3-offload": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
    }.items():
        (m,), _ = run_chain(tmp_path, name, data[:1], tiny_model_dir, 2, fp32 | extra)
        assert m["optimizer_steps"] == one[0]["optimizer_steps"], name
        assert m["loss"] == pytest.approx(one[0]["loss"], abs=1e-6), name
        assert m["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5), name
        assert update_distance(safetensors_of(one[0]), safetensors_of(m), start) < 1e-4, name
    model = load_model(Path(three[-1]["outputs"]["model"]))
    saved = {n: p.detach() for n, p in model.named_parameters()}
    assert saved.keys() == three_state["params"].keys()
    assert all(torch.equal(saved[n], three_state["params"][n]) for n in saved)


def test_rank_bundles_take_a_gpu_each_when_there_are_enough_and_custom_resources_place_them():
    """The GPU path's placement, checked without a GPU: one GPU per rank bundle only when the cluster has one for
    every rank; custom resources (training.rank_resources) go into every bundle; an unknown one is an error."""
    from pettingflow.training.learner import rank_bundle

    assert rank_bundle({"CPU": 16, "GPU": 8}, 8, 1.0) == {"CPU": 1.0, "GPU": 1}
    assert rank_bundle({"CPU": 16, "GPU": 1}, 2, 1.0) == {"CPU": 1.0}  # two ranks never share one GPU
    assert rank_bundle({"CPU": 4, "learner": 2}, 2, 1.0, {"learner": 1}) == {"CPU": 1.0, "learner": 1}
    with pytest.raises(ValueError, match="--resources"):
        rank_bundle({"CPU": 4, "learner": 1}, 2, 1.0, {"learner": 1})
    with pytest.raises(ValueError, match="custom resources only"):
        rank_bundle({"CPU": 4}, 1, 1.0, {"GPU": 1})


def test_deepspeed_config_derives_accumulation_from_the_mini_batch_and_the_world_size():
    from pettingflow.configs.settings import TrainingSettings
    from pettingflow.training.worker import deepspeed_config

    t = TrainingSettings(micro_batch_size=2, mini_batch_size=8, zero_stage=3, gradient_checkpointing=True)
    one, four = deepspeed_config(t, 1, "bf16"), deepspeed_config(t, 4, "bf16")
    assert (one["gradient_accumulation_steps"], four["gradient_accumulation_steps"]) == (4, 1)
    assert one["train_batch_size"] == four["train_batch_size"] == 8
    assert deepspeed_config(t, 3, "fp32")["gradient_accumulation_steps"] == 2  # ceil(ceil(8 / 3) / 2)
    assert one["zero_optimization"] == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert one["bf16"] == {"enabled": True} and "zero_force_ds_cpu_optimizer" not in one
    bf16_weights = t.model_copy(update={"master_weights": "bf16", "zero_stage": 0})
    assert deepspeed_config(bf16_weights, 1, "bf16")["bf16"] == {"enabled": False}  # torch's AdamW on bf16 weights
    # buckets sized by the model (transformers' "auto"), not DeepSpeed's 5e8 elements that ZeRO-3 keeps allocated
    sized = deepspeed_config(t, 2, "fp32", hidden_size=64)["zero_optimization"]
    assert sized["reduce_bucket_size"] == 4096 and sized["stage3_param_persistence_threshold"] == 640
    two = deepspeed_config(t.model_copy(update={"zero_stage": 2}), 2, "fp32", hidden_size=64)["zero_optimization"]
    assert two["allgather_bucket_size"] == 4096 and "stage3_prefetch_bucket_size" not in two
    off = deepspeed_config(t.model_copy(update={"offload_optimizer": True, "offload_params": True}), 2, "fp32")
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert off["zero_force_ds_cpu_optimizer"] is False  # torch's AdamW steps on the host: nothing JIT-compiled
    with pytest.raises(ValueError, match="not both"):
        TrainingSettings(mini_batch_size=8, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO"):
        TrainingSettings(zero_stage=0, offload_optimizer=True)
    with pytest.raises(ValueError, match="offload_params needs ZeRO-3"):
        TrainingSettings(zero_stage=2, offload_params=True)


def test_zero3_master_partitions_alias_fp32_weights_only_where_deepspeed_means_them_to():
    """share_fp32_master: an fp32 master partition equal to its fp32 weight partition takes that storage (the
    optimizer keeps its tensor object); a bf16 weight, an offloaded master or a partition already aliased stays as
    it is; a master that differs before any step is an error."""
    from types import SimpleNamespace

    from pettingflow.training.worker import share_fp32_master

    w32, w16 = torch.randn(6), torch.randn(4).bfloat16()
    m32, m16 = w32.clone(), w16.float()
    opt = SimpleNamespace(fp16_partitioned_groups_flat=[w32, w16], fp32_partitioned_groups_flat=[m32, m16])
    assert share_fp32_master(opt) == 6 * 4
    assert opt.fp32_partitioned_groups_flat[0] is m32 and m32.data_ptr() == w32.data_ptr()
    assert m16.data_ptr() != w16.data_ptr()
    m32.data.add_(1.0)  # an optimizer step on the master is a step on the weights
    assert torch.equal(w32, m32)
    assert share_fp32_master(opt) == 0  # already aliased
    offloaded = SimpleNamespace(
        fp16_partitioned_groups_flat=[w32], fp32_partitioned_groups_flat=[w32.clone()], offload_optimizer=True
    )
    assert share_fp32_master(offloaded) == 0
    assert share_fp32_master(SimpleNamespace()) == 0  # not a ZeRO-3 optimizer
    with pytest.raises(RuntimeError, match="differs"):
        share_fp32_master(SimpleNamespace(fp16_partitioned_groups_flat=[w32], fp32_partitioned_groups_flat=[w32 + 1]))


def test_zero0_allreduce_buckets_are_sized_to_the_model_only_where_deepspeed_flattens_everything():
    from types import SimpleNamespace

    from pettingflow.training.worker import allreduce_bucket_elements

    config = SimpleNamespace(hidden_size=1024)
    assert allreduce_bucket_elements(0, 2, config) == 1024 * 1024
    assert allreduce_bucket_elements(0, 1, config) is None  # one rank: nothing to reduce
    assert allreduce_bucket_elements(2, 2, config) is None  # ZeRO buckets come from the DeepSpeed config
    assert allreduce_bucket_elements(0, 2, SimpleNamespace()) is None
