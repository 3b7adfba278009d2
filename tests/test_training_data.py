"""Batch table -> tensors: alignment, masks, drops and the window plan, checked exactly on hand-made rows."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from factories import trajectory_row

from pettingflow.storage.schema import trajectories_to_table
from pettingflow.training.data import (
    BatchError,
    collate,
    filler,
    plan_windows,
    read_batch,
    samples_from_columns,
    samples_from_table,
)


def response_values(mb, values: torch.Tensor, b: int, prompt_len: int, response_len: int) -> torch.Tensor:
    """The ``[R]`` slice of a ``[B, W]`` per-token tensor that belongs to row ``b``'s response (inverse of collate)."""
    lo = prompt_len - 1 - mb.start
    return values[b, lo : lo + response_len]


def columns(rows: list[dict]) -> dict[str, list]:
    """Plain columns from partial rows; defaults for the bookkeeping columns."""
    defaults = {"agent_name": "a", "policy_name": "p", "lora_name": None, "advantage": 0.0}
    out: dict[str, list] = {}
    for key in ("prompt_ids", "response_ids", "response_mask", "sampler_logprobs", *defaults):
        out[key] = []
        for r in rows:
            if key == "sampler_logprobs" and key not in r:
                out[key].append([0.0] * len(r["response_ids"]))
            else:
                out[key].append(r.get(key, defaults.get(key)))
    return out


# Three rows of different prompt/response lengths: A (P3, R3), B (P2, R4), C (P1, R2).
ROWS = [
    {
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 12],
        "response_mask": [1, 0, 1],
        "sampler_logprobs": [-0.1, -0.2, -0.3],
        "advantage": 2.0,
    },
    {
        "prompt_ids": [4, 5],
        "response_ids": [20, 21, 22, 23],
        "response_mask": [1, 1, 0, 1],
        "sampler_logprobs": [-1.0, -2.0, -3.0, -4.0],
        "advantage": -1.0,
    },
    {"prompt_ids": [7], "response_ids": [30, 31], "response_mask": [1, 1], "advantage": 0.5},
]


def test_collate_alignment_masks_and_padding_exact():
    rows = samples_from_columns(columns(ROWS), max_seq_len=64)
    mb = collate(rows.samples, pad_id=0)
    # L = 6, start = min prompt length - 1 = 0, W = L - 1 - start = 5
    assert mb.start == 0 and mb.logits_to_keep == 6
    assert mb.input_ids.tolist() == [[1, 2, 3, 10, 11, 12], [4, 5, 20, 21, 22, 23], [7, 30, 31, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1] * 6, [1] * 6, [1, 1, 1, 0, 0, 0]]
    # column i is the target at position start + 1 + i, predicted by logits position start + i
    assert mb.targets.tolist() == [[2, 3, 10, 11, 12], [5, 20, 21, 22, 23], [30, 31, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]
    assert mb.advantages.tolist() == [[0, 0, 2, 0, 2], [0, -1, -1, 0, -1], [0.5, 0.5, 0, 0, 0]]
    assert torch.equal(
        mb.sampler_logprobs,
        torch.tensor(
            [[0, 0, -0.1, 0, -0.3], [0, -1.0, -2.0, 0, -4.0], [0, 0, 0, 0, 0]],
            dtype=torch.float32,
        ),
    )
    assert mb.rows == [0, 1, 2]
    assert mb.model_tokens == 7 and mb.tokens == 15
    # every masked column's target is a response token with mask 1
    for b, s in enumerate(rows.samples):
        resp = response_values(mb, mb.targets, b, len(s.prompt_ids), len(s.response_ids))
        assert resp.tolist() == s.response_ids.tolist()
        assert response_values(mb, mb.loss_mask, b, len(s.prompt_ids), len(s.response_ids)).tolist() == [
            float(v) for v in s.response_mask
        ]


def test_collate_skips_logits_before_the_shortest_prompt():
    rows = samples_from_columns(columns(ROWS[:2]), max_seq_len=64)
    mb = collate(rows.samples)
    # start = min(3, 2) - 1 = 1: position 0's logits (predicting a prompt token) are never computed
    assert mb.start == 1 and mb.logits_to_keep == 5
    assert mb.targets.tolist() == [[3, 10, 11, 12], [20, 21, 22, 23]]
    assert mb.loss_mask.tolist() == [[0, 1, 0, 1], [1, 1, 0, 1]]
    assert mb.advantages.tolist() == [[0, 2, 0, 2], [-1, -1, 0, -1]]


def test_drops_are_counted_and_logged(caplog):
    rows = [
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_mask": [1, 1]},  # length 5 == max: kept
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "response_mask": [1, 1, 1]},  # too long
        {"prompt_ids": [], "response_ids": [4], "response_mask": [1]},  # empty prompt
        {"prompt_ids": [1], "response_ids": [4, 5], "response_mask": [0, 0]},  # no model tokens
        {"prompt_ids": [1], "response_ids": [], "response_mask": []},  # no model tokens
    ]
    with caplog.at_level(logging.WARNING, logger="pettingflow.training.data"):
        out = samples_from_columns(columns(rows), max_seq_len=5)
    assert [s.row for s in out.samples] == [0]
    assert out.dropped == {"too_long": [1], "empty_prompt": [2], "no_model_tokens": [3, 4]}
    assert out.dropped_counts == {"too_long": 1, "empty_prompt": 1, "no_model_tokens": 2}
    assert out.n_dropped == 4 and out.total == 5
    assert "dropped 1 of 5 rows longer than max_seq_len=5" in caplog.text
    # the kept row is untouched: no truncation anywhere
    assert out.samples[0].prompt_ids.tolist() == [1, 2, 3] and out.samples[0].response_ids.tolist() == [4, 5]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"response_mask": [1, 1]}, "response_mask 2"),
        ({"sampler_logprobs": [0.0]}, "sampler_logprobs 1"),
        ({"response_mask": [1, 2, 0]}, "values other than 0 and 1"),
        ({"advantage": float("nan")}, "advantage must be a finite number"),
    ],
)
def test_inconsistent_rows_are_errors(bad, message):
    row = {"prompt_ids": [1], "response_ids": [4, 5, 6], "response_mask": [1, 1, 1], "advantage": 1.0} | bad
    with pytest.raises(BatchError, match=message):
        samples_from_columns(columns([row]), max_seq_len=64)


def write_batch(path, rows: list[dict], advantages: list[float]) -> None:
    table = trajectories_to_table(rows)
    table = table.append_column("advantage", pa.array(advantages, pa.float32()))
    pq.write_table(table, path)


def test_read_batch_local_file_folder_and_fsspec_uri(tmp_path):
    rows = [trajectory_row(sample_idx=i, agent_name=["x", "y"][i % 2]) for i in range(3)]
    write_batch(tmp_path / "batch.parquet", rows, [1.0, -1.0, 0.25])
    table = read_batch(str(tmp_path / "batch.parquet"))
    assert table.num_rows == 3 and table.column("advantage").to_pylist() == [1.0, -1.0, 0.25]
    got = samples_from_table(table, max_seq_len=64)
    assert [s.agent_name for s in got.samples] == ["x", "y", "x"]
    assert got.samples[0].response_mask.tolist() == [1, 1, 0, 1]
    assert got.samples[1].advantage == -1.0

    folder = tmp_path / "step"
    folder.mkdir()
    write_batch(folder / "part-0.parquet", rows[:2], [1.0, 2.0])
    write_batch(folder / "part-1.parquet", rows[2:], [3.0])
    (folder / "_COMMITTED.json").write_text("{}")
    assert sorted(read_batch(str(folder)).column("advantage").to_pylist()) == [1.0, 2.0, 3.0]

    import fsspec

    with fsspec.open("memory://training-test/batch.parquet", "wb") as f:
        f.write((tmp_path / "batch.parquet").read_bytes())
    assert read_batch("memory://training-test/batch.parquet").num_rows == 3


def test_read_batch_without_advantage_is_an_error(tmp_path):
    pq.write_table(trajectories_to_table([trajectory_row()]), tmp_path / "b.parquet")
    with pytest.raises(BatchError, match="advantage"):
        read_batch(str(tmp_path / "b.parquet"))


def _samples(agents: list[str]):
    rows = [
        {"prompt_ids": [1, 2], "response_ids": [3, 4 + i], "response_mask": [1, 1], "agent_name": a}
        for i, a in enumerate(agents)
    ]
    return samples_from_columns(columns(rows), max_seq_len=64).samples


def _plan(windows) -> list[list[list[list[int] | None]]]:
    """Rows per micro-batch slot, per rank, per window (None: a filler slot)."""
    return [[[[s.row for s in mb] if mb else None for mb in rank] for rank in w.slots] for w in windows]


def test_plan_windows_micro_batching_and_accumulation():
    samples = _samples(["a"] * 7)
    windows = plan_windows(samples, micro_batch_size=2, mini_batch_size=4)
    # 7 rows -> mini-batches of 4 and 3 rows -> micro-batches of 2,2 and 2,1
    assert _plan(windows) == [[[[0, 1], [2, 3]]], [[[4, 5], [6]]]]
    assert [w.rows for w in windows] == [4, 3] and [w.n_real for w in windows] == [2, 2]
    assert windows[0].loss_scale() == 2.0  # gas * world: DeepSpeed divides by both, the denominators are global
    assert [w.denominator for w in windows] == [8.0, 6.0]  # model tokens of the window (2 per row)
    assert [w.denominator for w in plan_windows(samples, 2, 4, loss_agg_mode="seq-mean-token-sum")] == [4.0, 3.0]
    partial = plan_windows(samples[:5], micro_batch_size=2, mini_batch_size=4)
    assert _plan(partial)[-1] == [[[4], None]]  # 1 row left: one real micro-batch and one filler slot
    with pytest.raises(ValueError, match="loss_agg_mode"):
        plan_windows(samples, 2, 4, loss_agg_mode="mean")


def test_plan_windows_world_size_changes_who_computes_never_which_rows_step():
    """The same mini-batches at 1, 2 and 3 ranks (7 rows: uneven splits, a rank with no rows), each rank's share
    contiguous, every rank with the same number of slots."""
    samples = _samples(["a"] * 7)
    for world in (1, 2, 3, 4):
        windows = plan_windows(samples, micro_batch_size=1, mini_batch_size=4, world_size=world)
        steps = [sorted(r for rank in w for mb in rank if mb for r in mb) for w in _plan(windows)]
        assert steps == [[0, 1, 2, 3], [4, 5, 6]], world
        assert all(len({len(rank) for rank in w.slots}) == 1 for w in windows)
        assert [w.denominator for w in windows] == [8.0, 6.0]
    assert _plan(plan_windows(samples, 1, 4, world_size=2)) == [
        [[[0], [1]], [[2], [3]]],
        [[[4], [5]], [[6], None]],  # 3 rows over 2 ranks: 2 + 1, rank 1 runs one filler
    ]
    assert _plan(plan_windows(samples, 2, 4, world_size=3)) == [
        [[[0, 1]], [[2]], [[3]]],
        [[[4]], [[5]], [[6]]],
    ]
    # a short last mini-batch: 2 rows over 3 ranks, 2 slots each (ceil(4 / 3) rows of a full one); rank 2 has none
    assert _plan(plan_windows(samples[:2], 1, 4, world_size=3)) == [[[[0], None], [[1], None], [None, None]]]


def test_plan_windows_skips_zero_advantage_rows_but_keeps_their_denominators_and_steps():
    samples = [replace(s, advantage=a) for s, a in zip(_samples(["a"] * 7), [1, 0, 0, -1, 0, 0, 0], strict=True)]
    for world in (1, 2):
        kept = plan_windows(samples, 1, 4, world_size=world)
        skipped = plan_windows(samples, 1, 4, world_size=world, skip_zero_advantage=True)
        assert [w.denominator for w in skipped] == [w.denominator for w in kept] == [8.0, 6.0]
        assert len(skipped) == 2 and [w.skipped for w in skipped] == [2, 3] and [w.rows for w in skipped] == [2, 0]
        assert [w.first.row for w in skipped] == [0, 4]  # what filler slots are cut from, trained or not
        assert all(len(rank) == len(kept[0].slots[0]) for w in skipped for rank in w.slots)
    assert _plan(plan_windows(samples, 1, 4, skip_zero_advantage=True)) == [
        [[[0], [3], None, None]],
        [[None, None, None, None]],  # every row skipped: the window still steps, on fillers
    ]


def test_plan_windows_by_adapter_never_mixes_agents_and_deals_ranks():
    samples = _samples(["a", "b", "a", "b", "a", "c"])
    windows = plan_windows(samples, micro_batch_size=1, mini_batch_size=2, world_size=2, by_adapter=True)
    plan = [(w.adapter, p) for w, p in zip(windows, _plan(windows), strict=True)]
    assert plan == [
        ("a", [[[0]], [[2]]]),
        ("a", [[[4]], [None]]),  # rank 1 runs a filler so both ranks step together
        ("b", [[[1]], [[3]]]),
        ("c", [[[5]], [None]]),
    ]
    for w in windows:
        agents = {s.agent_name for rank in w.slots for mb in rank if mb for s in mb}
        assert agents == {w.adapter}
    assert windows[1].loss_scale() == 2.0 and windows[1].denominator == 2.0  # gas * world; one row's 2 tokens
    # without by_adapter everything is one group, in table order
    assert [[s.row for s in mb] for mb in plan_windows(samples, 3, 6)[0].slots[0]] == [[0, 1, 2], [3, 4, 5]]


def test_filler_is_two_tokens_with_zero_mask():
    samples = _samples(["a", "a"])
    f = filler(samples, adapter="a")
    assert f.is_padding and f.adapter == "a"
    assert f.input_ids.tolist() == [[1, 3]] and f.targets.tolist() == [[3]]
    assert f.loss_mask.sum() == 0 and f.advantages.abs().sum() == 0


def test_collate_rejects_empty_input():
    with pytest.raises(ValueError):
        collate([])
    assert np.array_equal(_samples(["a"])[0].response_ids, [3, 4])
