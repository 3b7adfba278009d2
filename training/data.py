"""Batch table -> padded tensors and a micro-batch plan for the update job. Pure functions (no model, no I/O
except ``read_batch``), tested exactly on hand-made rows.

A batch row is one training sample: ``prompt_ids`` (the context the sampler saw), ``response_ids`` (what
follows it: model tokens and, for per-episode samples, env/observation tokens), ``response_mask`` (1 = model
token that gets gradient, 0 = env token), ``sampler_logprobs`` (one per response token) and ``advantage``
(one scalar per row, broadcast over its model tokens).

Alignment. A micro-batch of B rows is right-padded to ``L = max(len(prompt) + len(response))``:
``input_ids[b] = prompt_ids + response_ids + [pad] * k``. A causal LM's logits at position ``t`` predict the
token at ``t + 1``, so the log-prob of response token ``j`` of row ``b`` (at position ``p_b + j``, ``p_b`` =
prompt length) is read from logits position ``p_b + j - 1``. Only logits from ``start = min_b(p_b) - 1`` on
are needed, so the model is asked for the last ``L - start`` positions (``logits_to_keep``) and the last
one (which predicts past the end) is dropped. Every per-token tensor of a ``MicroBatch`` is therefore
``[B, W]`` with ``W = L - 1 - start``; column ``i`` holds target position ``start + 1 + i``:

- ``targets[b, i] = input_ids[b, start + 1 + i]``
- ``loss_mask[b, i] = response_mask[b][j]`` where ``j = start + 1 + i - p_b`` is a response index; 0 on
  prompt positions and padding
- ``advantages[b, i] = advantage[b] * loss_mask[b, i]``; ``sampler_logprobs`` placed like ``loss_mask``
  (0 outside the response).

Rows that cannot be trained are dropped, counted and logged, never silently altered:

- ``too_long``: ``len(prompt) + len(response) > max_seq_len``. Truncating would cut either the prompt (the
  model would be trained on a context it never saw) or the response (fine, but then the tail's log-probs
  and the per-episode structure are gone): dropping is the honest choice, and the count is reported so that
  a run that drops many rows is visible (raise ``training.max_seq_len`` or cap generation).
- ``empty_prompt``: the first response token would have no logit predicting it.
- ``no_model_tokens``: an empty response or an all-zero mask contributes nothing to any loss term.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from pettingflow.configs.settings import micro_steps_per_rank
from pettingflow.rl.advantages import broadcast_advantages
from pettingflow.rl.losses import loss_denominator

log = logging.getLogger(__name__)

BATCH_COLUMNS = (
    "prompt_ids",
    "response_ids",
    "response_mask",
    "sampler_logprobs",
    "agent_name",
    "policy_name",
    "lora_name",
    "advantage",
)
DROP_REASONS = ("too_long", "empty_prompt", "no_model_tokens")


class BatchError(ValueError):
    """A batch table that cannot be trained on as a whole (missing columns, inconsistent rows)."""


@dataclass(frozen=True, eq=False)
class Sample:
    """One trainable row, arrays as numpy."""

    row: int  # index in the batch table
    agent_name: str
    policy_name: str
    lora_name: str | None
    prompt_ids: np.ndarray  # int64 [P]
    response_ids: np.ndarray  # int64 [R]
    response_mask: np.ndarray  # int8 [R]
    sampler_logprobs: np.ndarray  # float32 [R]
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def model_tokens(self) -> int:
        return int(self.response_mask.sum())


@dataclass
class BatchRows:
    """What ``samples_from_table`` kept and what it dropped (row indexes per reason)."""

    samples: list[Sample]
    total: int
    dropped: dict[str, list[int]] = field(default_factory=lambda: {r: [] for r in DROP_REASONS})

    @property
    def dropped_counts(self) -> dict[str, int]:
        return {reason: len(rows) for reason, rows in self.dropped.items()}

    @property
    def n_dropped(self) -> int:
        return sum(len(v) for v in self.dropped.values())


def read_batch(uri: str, storage_options: dict[str, Any] | None = None) -> Any:
    """Read a batch Parquet file (or a folder of them) from a local path or fsspec URI -> ``pyarrow.Table``.

    Only the columns training needs are read. Files whose names start with ``_`` or ``.`` (commit markers,
    temp files) are ignored when ``uri`` is a folder.
    """
    import pyarrow.parquet as pq

    from pettingflow.storage.fs import filesystem

    fs, path = filesystem(uri, storage_options)
    schema_names = pq.read_schema(_first_parquet(fs, path), filesystem=fs).names
    missing = [c for c in BATCH_COLUMNS if c not in schema_names]
    if missing:
        raise BatchError(f"batch {uri} lacks columns {missing}; a batch is trajectory rows plus an 'advantage' column")
    return pq.read_table(path, filesystem=fs, columns=list(BATCH_COLUMNS))


def _first_parquet(fs: Any, path: str) -> str:
    if not fs.isdir(path):
        return path
    files = sorted(
        p
        for p in fs.ls(path, detail=False)
        if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith(("_", "."))
    )
    if not files:
        raise BatchError(f"batch folder {path} holds no .parquet file")
    return files[0]


def samples_from_table(table: Any, max_seq_len: int) -> BatchRows:
    """Turn a batch table (pyarrow) into ``Sample``s, dropping and counting untrainable rows (module doc)."""
    missing = [c for c in BATCH_COLUMNS if c not in table.column_names]
    if missing:
        raise BatchError(f"batch table lacks columns {missing}")
    cols = {c: table.column(c).to_pylist() for c in BATCH_COLUMNS}
    return samples_from_columns(cols, max_seq_len)


def samples_from_columns(cols: dict[str, Sequence[Any]], max_seq_len: int) -> BatchRows:
    """Same as ``samples_from_table`` from plain python columns (``{name: [value per row]}``)."""
    n = len(cols["prompt_ids"])
    out = BatchRows(samples=[], total=n)
    for i in range(n):
        prompt = np.asarray(cols["prompt_ids"][i], dtype=np.int64)
        response = np.asarray(cols["response_ids"][i], dtype=np.int64)
        mask = np.asarray(cols["response_mask"][i], dtype=np.int8)
        logprobs = np.asarray(cols["sampler_logprobs"][i], dtype=np.float32)
        if len(mask) != len(response) or len(logprobs) != len(response):
            raise BatchError(
                f"row {i}: response_ids has {len(response)} entries, response_mask {len(mask)}, "
                f"sampler_logprobs {len(logprobs)}"
            )
        if ((mask != 0) & (mask != 1)).any():
            raise BatchError(f"row {i}: response_mask holds values other than 0 and 1")
        advantage = cols["advantage"][i]
        if advantage is None or not np.isfinite(advantage):
            raise BatchError(f"row {i}: advantage must be a finite number, got {advantage!r}")
        if len(prompt) + len(response) > max_seq_len:
            out.dropped["too_long"].append(i)
            continue
        if len(prompt) == 0:
            out.dropped["empty_prompt"].append(i)
            continue
        if len(response) == 0 or not mask.any():
            out.dropped["no_model_tokens"].append(i)
            continue
        out.samples.append(
            Sample(
                row=i,
                agent_name=str(cols["agent_name"][i]),
                policy_name=str(cols["policy_name"][i]),
                lora_name=cols["lora_name"][i],
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                sampler_logprobs=logprobs,
                advantage=float(advantage),
            )
        )
    if out.dropped["too_long"]:
        rows = out.dropped["too_long"]
        log.warning(
            "dropped %d of %d rows longer than max_seq_len=%d (rows %s%s); raise training.max_seq_len or cap "
            "generation to train on them",
            len(rows),
            n,
            max_seq_len,
            rows[:10],
            "..." if len(rows) > 10 else "",
        )
    for reason in ("empty_prompt", "no_model_tokens"):
        if out.dropped[reason]:
            log.info("dropped %d rows (%s)", len(out.dropped[reason]), reason)
    return out


# ------------------------------------------------------------------------------------------------ tensors
@dataclass
class MicroBatch:
    """Padded tensors of B rows; per-token tensors are ``[B, W]`` over target positions (module doc)."""

    input_ids: torch.Tensor  # long [B, L]
    attention_mask: torch.Tensor  # long [B, L]
    start: int  # first logits position needed; logits_to_keep = L - start, then drop the last
    targets: torch.Tensor  # long [B, W]
    loss_mask: torch.Tensor  # float32 [B, W], 0/1
    advantages: torch.Tensor  # float32 [B, W]
    sampler_logprobs: torch.Tensor  # float32 [B, W]
    rows: list[int]
    adapter: str | None = None  # LoRA adapter to activate (L2), None for full-weight updates
    old_logprobs: torch.Tensor | None = None  # filled before training
    ref_logprobs: torch.Tensor | None = None  # filled before training when kl_coef > 0
    is_padding: bool = False  # a filler micro-batch with an all-zero loss mask (see plan_windows)
    prompt_lens: list[int] = field(default_factory=list)  # P_b per row
    prompt_groups: list[list[int]] = field(default_factory=list)  # rows (b) with identical prompts, first-seen order

    @property
    def logits_to_keep(self) -> int:
        return self.input_ids.shape[1] - self.start

    @property
    def model_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def computed_tokens(self, share_prompts: bool) -> int:
        """Tokens the forward runs: ``tokens``, less the prompt repeats a shared-prompt forward computes once per
        group (the roofline counts FLOPs done, not rows)."""
        if not share_prompts or not self.prompt_lens:
            return self.tokens
        repeats = sum((len(g) - 1) * self.prompt_lens[g[0]] for g in self.prompt_groups if len(g) > 1)
        return self.tokens - repeats

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device`` (the DeepSpeed engine's device)."""
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids", "attention_mask", "targets", "loss_mask", "advantages", "sampler_logprobs")
        }
        return replace(self, **moved)

    def as_padding(self) -> MicroBatch:
        """A copy whose loss mask is all zero: forward/backward touch the same weights, gradient exactly 0."""
        zeros = torch.zeros_like(self.loss_mask)
        return replace(self, loss_mask=zeros, advantages=zeros.clone(), is_padding=True)


def filler(samples: Sequence[Sample], adapter: str | None = None) -> MicroBatch:
    """A cheap filler micro-batch: the first token of the first sample's prompt and response, zero loss mask.

    It runs the same weights (same adapter) as a real micro-batch, so DeepSpeed's per-parameter gradient hooks
    fire identically on every rank, at the cost of a 2-token forward.
    """
    s = samples[0]
    tiny = replace(
        s,
        prompt_ids=s.prompt_ids[:1],
        response_ids=s.response_ids[:1],
        response_mask=np.ones(1, dtype=np.int8),
        sampler_logprobs=s.sampler_logprobs[:1],
    )
    return collate([tiny], adapter=adapter).as_padding()


def collate(samples: Sequence[Sample], pad_id: int = 0, adapter: str | None = None) -> MicroBatch:
    """Right-pad ``samples`` into one ``MicroBatch`` with the alignment of the module docstring."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    if any(len(s.prompt_ids) == 0 for s in samples):
        raise ValueError("every sample needs a non-empty prompt (the first response token needs a logit)")
    B = len(samples)
    L = max(s.length for s in samples)
    start = min(len(s.prompt_ids) for s in samples) - 1
    W = L - 1 - start
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, W), dtype=torch.float32)
    sampler_logprobs = torch.zeros((B, W), dtype=torch.float32)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        input_ids[b, :P] = torch.from_numpy(s.prompt_ids)
        input_ids[b, P : P + R] = torch.from_numpy(s.response_ids)
        attention_mask[b, : P + R] = 1
        # response token j sits at position P + j, i.e. column P + j - 1 - start
        lo = P - 1 - start
        mask = torch.from_numpy(s.response_mask.astype(np.float32))
        loss_mask[b, lo : lo + R] = mask
        sampler_logprobs[b, lo : lo + R] = torch.from_numpy(s.sampler_logprobs) * mask
    targets = input_ids[:, start + 1 :].clone()
    # every model token of a row carries the row's advantage; env tokens, prompt and padding carry 0
    advantages = broadcast_advantages(torch.tensor([s.advantage for s in samples], dtype=torch.float32), loss_mask)
    return MicroBatch(
        prompt_lens=[len(s.prompt_ids) for s in samples],
        prompt_groups=prompt_groups(samples),
        input_ids=input_ids,
        attention_mask=attention_mask,
        start=start,
        targets=targets,
        loss_mask=loss_mask,
        advantages=advantages,
        sampler_logprobs=sampler_logprobs,
        rows=[s.row for s in samples],
        adapter=adapter,
    )


def prompt_groups(samples: Sequence[Sample]) -> list[list[int]]:
    """Positions of ``samples`` grouped by identical prompt ids, groups in order of first appearance.

    The G samples of a GRPO group drawn from one prompt share it token for token; the update computes that
    prompt once per group (``logprobs.response_logits``).
    """
    groups: dict[bytes, list[int]] = {}
    for b, s in enumerate(samples):
        groups.setdefault(np.ascontiguousarray(s.prompt_ids, dtype=np.int64).tobytes(), []).append(b)
    return list(groups.values())


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class Window:
    """One mini-batch: the rows of one optimizer step, already split over ranks into micro-batches.

    ``slots[r]`` is rank r's list of exactly ``micro_steps`` sample lists; ``None`` marks a filler slot (the
    rank runs a 2-token, zero-mask ``filler`` so that every rank calls forward and backward equally often,
    through the same weights, which DeepSpeed's collectives and its fixed accumulation count need).
    ``denominator`` is the loss denominator of the whole window (``rl.losses.loss_denominator`` of its rows:
    their model tokens, or the rows themselves for the seq modes): each micro-batch's loss is its share of the
    window's loss, so the gradient is that of the window whichever rank computed which rows.
    """

    adapter: str | None
    slots: list[list[list[Sample] | None]]
    denominator: float = 1.0
    first: Sample | None = None  # the window's first row, trained or not: what its filler slots are cut from
    skipped: int = 0  # rows left out for an advantage of exactly 0 (``plan_windows``' ``skip_zero_advantage``)
    # ``denominator`` and model tokens of the rows the ranks compute (``skipped`` ones left out): what each rank
    # weighs its micro-batches' metrics against, so that a step's reported value needs no collective
    trained_denominator: float = 1.0
    trained_tokens: int = 0

    @property
    def n_real(self) -> int:
        """Real (non-filler) micro-batches over all ranks."""
        return sum(mb is not None for rank in self.slots for mb in rank)

    @property
    def rows(self) -> int:
        """Rows of the window over all ranks."""
        return sum(len(mb) for rank in self.slots for mb in rank if mb is not None)

    def loss_scale(self) -> float:
        """Factor on each micro-batch's (share of the) loss: DeepSpeed divides by its accumulation steps and
        averages gradients over ranks; multiplying by both makes the step's gradient the sum of the shares."""
        world = len(self.slots)
        gas = len(self.slots[0])
        return float(gas * world)


def group_key(sample: Sample, by_adapter: bool) -> str | None:
    """Adapter (= agent) a sample trains in L2; None when all rows update the same weights."""
    return sample.agent_name if by_adapter else None


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds of ``parts`` contiguous chunks of ``range(n)``; the first ``n % parts`` get one more.

    Contiguous, so the rows of one GRPO group (one prompt) mostly stay on one rank and share their prompt.
    """
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def plan_windows(
    samples: Iterable[Sample],
    micro_batch_size: int,
    mini_batch_size: int,
    world_size: int = 1,
    by_adapter: bool = False,
    loss_agg_mode: str = "token-mean",
    skip_zero_advantage: bool = False,
) -> list[Window]:
    """Split samples into optimizer-step windows, deterministically (every rank computes the same plan).

    Rows keep their table order. With ``by_adapter`` (L2), rows are grouped by agent first (groups in order of
    first appearance) and no micro-batch or window mixes agents, so each optimizer step touches one adapter.
    Each window holds the next ``mini_batch_size`` rows (the last one of a group may hold fewer), whatever
    the world size: the world size changes who computes which rows, never which rows make a step. The
    window's rows are split into ``world_size`` contiguous near-equal shares (``split_evenly``), each cut into
    micro-batches of ``micro_batch_size`` rows; every rank gets the same number of slots (``micro_steps``,
    the most any rank can need), ranks left short get filler slots (``None``) — a rank may have none of a
    window's rows at all.

    ``skip_zero_advantage``: rows whose advantage is exactly 0 stay in their window's loss denominator but out
    of its slots. With no KL or entropy term their gradient is 0, so the step's gradient is unchanged; the
    window keeps its optimizer step even when every row is skipped (all fillers: Adam's moments and weight
    decay still move the weights, as they would have), so the weights come out as without skipping.
    """
    if micro_batch_size < 1 or mini_batch_size < 1 or world_size < 1:
        raise ValueError("micro_batch_size, mini_batch_size and world_size must be >= 1")
    groups: dict[str | None, list[Sample]] = {}
    for s in samples:
        groups.setdefault(group_key(s, by_adapter), []).append(s)
    micro_steps = micro_steps_per_rank(mini_batch_size, micro_batch_size, world_size)
    windows: list[Window] = []
    for key, rows in groups.items():
        for w in range(0, len(rows), mini_batch_size):
            chunk = rows[w : w + mini_batch_size]
            trained = [s for s in chunk if s.advantage != 0.0] if skip_zero_advantage else chunk
            slots: list[list[list[Sample] | None]] = []
            for lo, hi in split_evenly(len(trained), world_size):
                share = trained[lo:hi]
                mbs: list[list[Sample] | None] = [
                    share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)
                ]
                slots.append(mbs + [None] * (micro_steps - len(mbs)))
            # every trainable row has >= 1 model token (samples_from_columns drops the others)
            denominator = loss_denominator([s.model_tokens for s in chunk], loss_agg_mode)
            windows.append(
                Window(
                    adapter=key,
                    slots=slots,
                    denominator=denominator,
                    first=chunk[0],
                    skipped=len(chunk) - len(trained),
                    trained_denominator=loss_denominator([s.model_tokens for s in trained], loss_agg_mode),
                    trained_tokens=sum(s.model_tokens for s in trained),
                )
            )
    return windows
