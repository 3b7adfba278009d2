"""Log-probs and the PPO loss of one micro-batch under a model's forward (the inputs of ``rl.losses``).

The loss formula itself is ``pettingflow.rl.losses.total_loss`` (pure); this module runs the forward that
feeds it: a padded forward, or the shared-prompt forward where a GRPO group's prompt is computed once; then the
LM head over the response tokens, at once or in checkpointed chunks (``chunked_head``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.rl.losses import entropy_from_logits, entropy_metric, total_loss
from pettingflow.training.data import MicroBatch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., target]``: ``[..., V], [...] -> [...]``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def response_logits(forward: Callable[..., Any], mb: MicroBatch, share_prompts: bool = True) -> torch.Tensor:
    """``[N, V]`` float32 logits predicting the loss-mask tokens of ``mb``, in the order of ``mb.loss_mask != 0``
    (row by row, left to right), so that ``response_logits(...)[i]`` predicts ``mb.targets[valid][i]``.

    With ``share_prompts``, rows that share one prompt token for token (the G samples of a GRPO group) run the
    prompt once: one forward over the prompt fills a KV cache, the cache is repeated G times and the G
    responses run on top of it (explicit positions ``P, P+1, ...``). Gradients flow back into the prompt
    through the cached keys and values, so log-probs and gradients equal the padded forward over full rows
    (up to float rounding: the tests check both); the compute drops from ``G (P + R)`` to ``P + G R`` tokens,
    which halved the update of a 250-token prompt x 4 samples of 110 tokens. Rows with a prompt of their own
    (later turns of multi-turn episodes) run together in one padded forward, as without sharing.
    """
    return _response_positions(forward, mb, share_prompts, lambda out, keep: out.logits.float())


def response_hidden(forward: Callable[..., Any], mb: MicroBatch, share_prompts: bool = True) -> torch.Tensor:
    """``[N, H]``: the final hidden states (after the last norm, what the LM head reads) at the positions whose
    logits ``response_logits`` returns, in the same order; the LM head is applied to one position per forward only.

    Why: the vocabulary-wide logits of every response token (``N x V``: 4 B x 49k per token in fp32) are the
    largest activation left once the decoder layers are checkpointed; ``chunked_head`` computes them a few
    hundred tokens at a time from these hidden states instead. ``forward`` is a Hugging Face causal LM or a
    DeepSpeed engine around one (``.module``); the states are taken by a forward hook on its decoder, so the
    call still goes through the engine (ZeRO-3 gathers parameters in its hooks).
    """
    decoder = causal_lm(forward).get_decoder()
    seen: list[torch.Tensor] = []

    def keep_output(module: Any, args: Any, output: Any) -> None:
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    def take(out: Any, keep: int) -> torch.Tensor:
        hidden = seen.pop()
        return hidden[:, -keep:, :] if keep else hidden

    handle = decoder.register_forward_hook(keep_output)
    try:
        return _response_positions(forward, mb, share_prompts, take, head_positions=1)
    finally:
        handle.remove()


def causal_lm(forward: Callable[..., Any]) -> Any:
    """The Hugging Face model behind ``forward``: a DeepSpeed engine's ``.module``, else ``forward`` itself."""
    model = getattr(forward, "module", forward)
    if not hasattr(model, "get_decoder") or not hasattr(model, "get_output_embeddings"):
        raise TypeError(
            f"the LM head can be chunked only for a Hugging Face causal LM (or a DeepSpeed engine around one), "
            f"got {type(forward).__name__}: set training.head_chunk_tokens=0"
        )
    return model


def _response_positions(
    forward: Callable[..., Any],
    mb: MicroBatch,
    share_prompts: bool,
    take: Callable[[Any, int], torch.Tensor],
    head_positions: int | None = None,
) -> torch.Tensor:
    """The per-position outputs ``take(out, logits_to_keep)`` (logits or hidden states, ``[B, T, D]``) of the
    forwards of ``response_logits``, at the loss-mask positions, as ``[N, D]``. ``head_positions``: the
    ``logits_to_keep`` passed to the model instead of the one wanted (1: the head runs on one position only)."""

    def keep_arg(keep: int) -> int:
        return keep if head_positions is None else head_positions

    valid = mb.loss_mask != 0
    groups = [g for g in mb.prompt_groups if len(g) > 1] if share_prompts else []
    if not groups:
        out = forward(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            logits_to_keep=keep_arg(mb.logits_to_keep),
            use_cache=False,
        )
        states = take(out, mb.logits_to_keep)[:, :-1, :]
        if states.shape[1] != mb.targets.shape[1]:
            raise RuntimeError(f"logits cover {states.shape[1]} positions, targets {mb.targets.shape[1]}")
        return states[valid]
    per_row: dict[int, torch.Tensor] = {}
    singles = sorted(set(range(mb.input_ids.shape[0])) - {b for g in groups for b in g})
    if singles:
        idx = torch.tensor(singles, device=mb.input_ids.device)
        out = forward(
            input_ids=mb.input_ids[idx],
            attention_mask=mb.attention_mask[idx],
            logits_to_keep=keep_arg(mb.logits_to_keep),
            use_cache=False,
        )
        states = take(out, mb.logits_to_keep)[:, :-1, :]
        for k, b in enumerate(singles):
            per_row[b] = states[k][valid[b]]
    lengths = mb.attention_mask.sum(dim=1).tolist()
    for group in groups:
        P = mb.prompt_lens[group[0]]
        R = max(int(lengths[b]) - P for b in group)
        prompt = forward(
            input_ids=mb.input_ids[group[0], :P].unsqueeze(0),
            attention_mask=mb.attention_mask[group[0], :P].unsqueeze(0),
            logits_to_keep=1,
            use_cache=True,
        )
        first = take(prompt, 1)[:, -1:, :]
        cache = prompt.past_key_values
        cache.batch_repeat_interleave(len(group))
        idx = torch.tensor(group, device=mb.input_ids.device)
        positions = torch.arange(P, P + R, device=mb.input_ids.device).unsqueeze(0).expand(len(group), -1)
        out = forward(
            input_ids=mb.input_ids[idx, P : P + R],
            attention_mask=mb.attention_mask[idx, : P + R],
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=keep_arg(0),
            use_cache=True,
        )
        # response token j is predicted by the prompt's last position (j = 0) or the response position j - 1
        states = torch.cat([first.expand(len(group), -1, -1), take(out, 0)[:, : R - 1, :]], dim=1)  # [n, R, D]
        for k, b in enumerate(group):
            lo = P - 1 - mb.start  # column of response token 0
            per_row[b] = states[k][valid[b, lo : lo + R]]
    return torch.cat([per_row[b] for b in range(mb.input_ids.shape[0])], dim=0)


def chunked_head(
    forward: Callable[..., Any],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    entropy_grad: bool,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob of each target, entropy)``, both ``[N]``, from ``[N, H]`` final hidden states, ``chunk_tokens``
    rows at a time.

    Each chunk's logits, log-softmax and entropy live only while that chunk is computed: under autograd the
    chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant), so its backward recomputes the chunk's
    logits from the saved hidden states instead of keeping ``N x V`` logits and log-softmax for the whole
    micro-batch. Cost: one more LM-head matmul per chunk in the backward pass. The values and gradients equal
    the unchunked computation up to float rounding (the tests check both). The entropy carries gradient only
    with ``entropy_grad`` (``entropy_coef > 0``); otherwise it is the metric, computed once per chunk (not again
    in the recompute).

    ``agree(n)``: the number of chunks every rank runs, given this rank's ``n`` (the worker passes the max over
    ranks under ZeRO-3, where each call of the head module gathers its weight with a collective, so all ranks
    must call it equally often: a rank with fewer tokens runs empty chunks, which still take part in the
    forward and the backward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head = causal_lm(forward).get_output_embeddings()

    def compute(h: torch.Tensor, t: torch.Tensor, metric: list[torch.Tensor]) -> Any:
        logits = head(h).float()
        if entropy_grad:
            return token_logprobs(logits, t), entropy_from_logits(logits)
        if not metric:  # the first pass; a checkpoint's recompute in the backward needs the log-probs only
            metric.append(entropy_metric(logits))
        return token_logprobs(logits, t)

    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    chunks = -(-hidden.shape[0] // chunk_tokens)
    if agree is not None:
        chunks = agree(chunks)
    for lo in range(0, chunks * chunk_tokens, chunk_tokens):
        h, t = hidden[lo : lo + chunk_tokens], targets[lo : lo + chunk_tokens]
        metric: list[torch.Tensor] = []
        if torch.is_grad_enabled() and h.requires_grad:
            out = checkpoint(compute, h, t, metric, use_reentrant=False)
        else:
            out = compute(h, t, metric)
        logp, entropy = out if entropy_grad else (out, metric[0])
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def scatter_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` tensor holding ``values`` (one per ``mask != 0`` position, row-major) and 0 elsewhere.

    The vocabulary-sized softmax is the costliest part after the transformer itself; prompt, env-token and
    padding columns never need it, so per-token quantities are computed on the valid positions only.
    """
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask != 0, values)


@torch.no_grad()
def micro_batch_logprobs(
    forward: Callable[..., Any],
    mb: MicroBatch,
    share_prompts: bool = True,
    head_chunk_tokens: int = 0,
    agree: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """Log-probs of ``mb.targets`` under ``forward`` (no gradient); 0 outside the loss mask.
    ``head_chunk_tokens``, ``agree``: see ``micro_batch_loss``."""
    targets = mb.targets[mb.loss_mask != 0]
    if head_chunk_tokens:
        hidden = response_hidden(forward, mb, share_prompts)
        logp, _ = chunked_head(forward, hidden, targets, head_chunk_tokens, entropy_grad=False, agree=agree)
    else:
        logp = token_logprobs(response_logits(forward, mb, share_prompts), targets)
    return scatter_valid(logp, mb.loss_mask)


def micro_batch_loss(
    forward: Callable[..., Any],
    mb: MicroBatch,
    algo: AlgorithmSettings,
    *,
    old_is_current: bool = False,
    share_prompts: bool = True,
    denominator: float | None = None,
    head_chunk_tokens: int = 0,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO loss of one micro-batch (``total_loss``) with the current policy's log-probs.

    Needs ``mb.old_logprobs`` (and ``mb.ref_logprobs`` when ``kl_coef > 0``), unless ``old_is_current``: no optimizer
    step has happened yet in this update, so the old log-probs (those of the weights the update started
    from) equal the current ones and are taken from this forward, detached, instead of a separate one
    (ratio 1; TRL does the same with one iteration per generation batch).
    Entropy is always reported (over the model tokens only); it carries gradient only when
    ``entropy_coef > 0``. Metrics also get ``logprob_mean`` (mean current log-prob of the model tokens),
    ``model_tokens`` and, with ``old_is_current``, ``sampler_abs_diff_sum`` (sum of |current - sampler|).
    ``share_prompts``: see ``response_logits``. ``denominator``: the loss denominator of the whole mini-batch
    (``data.Window.denominator``); the loss is then this micro-batch's share of it (``rl.losses.masked_aggregate``).
    ``head_chunk_tokens`` > 0: the LM head, log-softmax and entropy run that many model tokens at a time and are
    recomputed in the backward pass (``chunked_head``), so no ``N x V`` logits stay alive; 0: all at once.
    ``agree``: makes the ranks run the same number of chunks (``chunked_head``).
    """
    if mb.old_logprobs is None and not old_is_current:
        raise ValueError("micro-batch has no old log-probs; compute them before training")
    if algo.kl_coef > 0 and mb.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs on the micro-batch")
    valid = mb.loss_mask != 0
    if head_chunk_tokens:
        hidden = response_hidden(forward, mb, share_prompts)
        token_logp, token_entropy = chunked_head(
            forward, hidden, mb.targets[valid], head_chunk_tokens, entropy_grad=algo.entropy_coef > 0, agree=agree
        )
    else:
        logits = response_logits(forward, mb, share_prompts)
        token_logp = token_logprobs(logits, mb.targets[valid])
        token_entropy = entropy_from_logits(logits) if algo.entropy_coef > 0 else entropy_metric(logits)
    logp = scatter_valid(token_logp, mb.loss_mask)
    entropy = scatter_valid(token_entropy, mb.loss_mask)
    old = logp.detach() if old_is_current else mb.old_logprobs
    loss, metrics = total_loss(
        logp,
        old,
        mb.advantages,
        mb.loss_mask,
        ref_logprobs=mb.ref_logprobs,
        entropy=entropy,
        clip_ratio_low=algo.clip_ratio_low,
        clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        loss_agg_mode=algo.loss_agg_mode,
        denominator=denominator,
    )
    n = int(valid.sum())
    metrics["logprob_mean"] = float(logp.detach().sum() / max(n, 1))
    metrics["model_tokens"] = float(n)
    if old_is_current:
        metrics["sampler_abs_diff_sum"] = float((old - mb.sampler_logprobs).abs()[valid].sum())
    return loss, metrics
