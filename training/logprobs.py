"""Log-probs and the PPO loss of one micro-batch under a model's forward (the inputs of ``rl.losses``).

The loss formula itself is ``pettingflow.rl.losses.total_loss`` (pure); this module runs the forward that
feeds it: a padded forward, or the shared-prompt forward where a GRPO group's prompt is computed once; then the
LM head at the positions the loss uses only (``lm_head``, guarded by ``check_head``), at once or in checkpointed
chunks (``chunked_head``); then the token log-probs as the target's logit minus a chunked logsumexp
(``token_logprobs``), never a full fp32 copy of the vocabulary-sized logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.rl.losses import entropy_from_logits, total_loss
from pettingflow.training.data import MicroBatch


class _TokenLogprobs(torch.autograd.Function):
    """``logits[target] - logsumexp(logits)`` with the logsumexp taken ``rows`` rows at a time in fp32.

    Why not ``log_softmax(logits.float()).gather(...)``: that keeps a full fp32 copy of the ``[N, V]`` logits
    alive and saves the ``[N, V]`` fp32 log-softmax for the backward pass (8 B x vocab per token on top of the
    logits themselves: 0.4 GB per 1,000 tokens for SmolLM2's 49k vocabulary). Here only the logits (in their own
    dtype, bf16 in training) and one fp32 logsumexp per row are saved; the backward rebuilds ``softmax`` a chunk
    at a time: ``d logp / d logits = onehot(target) - softmax(logits)``. The same pass gives the entropy metric
    (``lse - sum p x``), so no second softmax is taken for it.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = logits.reshape(-1, logits.shape[-1])
        n = flat.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        lowest = torch.finfo(torch.float32).min
        for lo in range(0, n, rows):
            x = torch.clamp(flat[lo : lo + rows].float(), min=lowest)  # -inf logits: p = 0 and p * x = 0, not nan
            top = x.amax(dim=-1, keepdim=True)
            e = torch.exp(x - top)
            total = e.sum(dim=-1)
            lse[lo : lo + rows] = top.squeeze(-1) + total.log()
            if with_entropy:  # H = lse - sum_v p_v x_v
                entropy[lo : lo + rows] = lse[lo : lo + rows] - (e * x).sum(dim=-1) / total
        picked = flat.gather(-1, targets.reshape(-1, 1)).squeeze(-1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        entropy = entropy.reshape(targets.shape) if with_entropy else entropy
        ctx.mark_non_differentiable(entropy)
        return (picked - lse).reshape(targets.shape), entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad.reshape(-1, 1).float()
        t = targets.reshape(-1, 1)
        out = torch.empty_like(flat)
        for lo in range(0, flat.shape[0], ctx.rows):
            hi = lo + ctx.rows
            d = torch.exp(flat[lo:hi].float() - lse[lo:hi, None]).mul_(-g[lo:hi])
            d.scatter_add_(-1, t[lo:hi], g[lo:hi])
            out[lo:hi] = d
        return out.reshape(logits.shape), None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int = 64) -> torch.Tensor:
    """``log softmax(logits)[..., target]`` in fp32: ``[..., V], [...] -> [...]`` (``_TokenLogprobs``: no fp32
    copy of the logits, the softmax a few rows at a time)."""
    _check_head_inputs(logits, targets, rows_per_chunk)
    return _TokenLogprobs.apply(logits, targets, rows_per_chunk, False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob of each target, entropy)`` in fp32 from ``[..., V]`` logits of any float dtype, in one pass
    over the vocabulary; the log-prob carries gradient, the entropy is the metric (no gradient: for an entropy
    bonus use ``rl.losses.entropy_from_logits``)."""
    _check_head_inputs(logits, targets, rows_per_chunk)
    return _TokenLogprobs.apply(logits, targets, rows_per_chunk, True)


def _check_head_inputs(logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int) -> None:
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dimension, got {tuple(logits.shape)}")


def response_logits(forward: Callable[..., Any], mb: MicroBatch, share_prompts: bool = True) -> torch.Tensor:
    """``[N, V]`` logits (the model's own forward's, in its dtype) predicting the loss-mask tokens of ``mb``, in
    the order of ``mb.loss_mask != 0`` (row by row, left to right), so that ``response_logits(...)[i]`` predicts
    ``mb.targets[valid][i]``.

    With ``share_prompts``, rows that share one prompt token for token (the G samples of a GRPO group) run the
    prompt once: one forward over the prompt fills a KV cache, the cache is repeated G times and the G
    responses run on top of it (explicit positions ``P, P+1, ...``). Gradients flow back into the prompt
    through the cached keys and values, so log-probs and gradients equal the padded forward over full rows
    (up to float rounding: the tests check both); the compute drops from ``G (P + R)`` to ``P + G R`` tokens,
    which halved the update of a 250-token prompt x 4 samples of 110 tokens. Rows with a prompt of their own
    (later turns of multi-turn episodes) run together in one padded forward, as without sharing.
    """
    return _response_positions(forward, mb, share_prompts, lambda out, keep: out.logits)


def response_hidden(forward: Callable[..., Any], mb: MicroBatch, share_prompts: bool = True) -> torch.Tensor:
    """``[N, H]``: the final hidden states (after the last norm, what the LM head reads) at the positions whose
    logits ``response_logits`` returns, in the same order; the LM head is applied to one position per forward only.

    Why: the model's forward would apply the head to every position from the first response token on, prompt
    and env tokens of later turns and padding included; from these states ``lm_head`` computes it at the loss
    positions only, at once or a few hundred tokens at a time (``chunked_head``: the vocabulary-wide logits are
    the largest activation left once the decoder layers are checkpointed). ``forward`` is a Hugging Face causal
    LM or a DeepSpeed engine around one (``.module``); the states are taken by a forward hook on its decoder, so
    the call still goes through the engine (ZeRO-3 gathers parameters in its hooks). The one position whose
    logits the forward does compute checks ``lm_head`` against the model (``check_head``, once per model).

    Under autograd the forward also returns its hidden states, and the loss must reach the engine through the
    last of them (``_as_returned``): DeepSpeed starts its backward pass (ZeRO-2's accumulation
    boundary, the offload bookkeeping) from hooks on the forward's outputs, and a loss that reached the weights
    only through a hooked-out tensor trained ZeRO-2 + optimizer offload on wrong gradients.
    """
    decoder = causal_lm(forward).get_decoder()
    seen: list[torch.Tensor] = []

    def keep_output(module: Any, args: Any, output: Any) -> None:
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    def take(out: Any, keep: int) -> torch.Tensor:
        hidden = seen.pop()
        if hidden.requires_grad:
            hidden = _as_returned(forward, out, hidden)
        check_head(forward, hidden[:, -1:, :], out.logits[:, -1:, :])
        return hidden[:, -keep:, :] if keep else hidden

    handle = decoder.register_forward_hook(keep_output)
    try:
        return _response_positions(
            forward, mb, share_prompts, take, head_positions=1, hidden_states=torch.is_grad_enabled()
        )
    finally:
        handle.remove()


def _as_returned(forward: Callable[..., Any], out: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` (the decoder's output, kept by a hook) as the forward returned it: the last of its
    ``hidden_states``, the same storage (under ZeRO-3 the engine's hooks wrap returned tensors in autograd nodes of
    their own, so it is not the same tensor object). The loss must flow through a returned tensor (see
    ``response_hidden``)."""
    returned = out.hidden_states[-1] if getattr(out, "hidden_states", None) else None
    if returned is None or returned.shape != hidden.shape or returned.data_ptr() != hidden.data_ptr():
        raise HeadError(
            f"{type(causal_lm(forward)).__name__} does not return its final hidden states as the last of its "
            f"hidden_states, so the loss would reach the weights around the forward's outputs: set "
            f"training.head_at_loss_positions=false (and training.head_chunk_tokens=0)"
        )
    return returned


def causal_lm(forward: Callable[..., Any]) -> Any:
    """The Hugging Face model behind ``forward``: a DeepSpeed engine's ``.module``, else ``forward`` itself."""
    model = getattr(forward, "module", forward)
    if not hasattr(model, "get_decoder") or not hasattr(model, "get_output_embeddings"):
        raise TypeError(
            f"the LM head can be chunked only for a Hugging Face causal LM (or a DeepSpeed engine around one), "
            f"got {type(forward).__name__}: set training.head_at_loss_positions=false and training.head_chunk_tokens=0"
        )
    return model


# Config entries under which a model's forward changes the LM head's output (a scale, a mask, a cut vocabulary):
# the head cannot be applied on its own to the hidden states then, so the loss-position head refuses them.
_HEAD_SCALES = ("logit_scale", "logits_scaling", "output_multiplier", "unpadded_vocab_size")


def lm_head(forward: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Final hidden states -> the logits the model's own forward would return for them.

    The plain output embedding, plus the tanh soft-cap of the models that cap their logits (Gemma 2-4:
    ``cap * tanh(logits / cap)``). A model whose forward scales, masks or cuts its logits otherwise (an entry of
    ``_HEAD_SCALES`` other than 1) is refused with what to set instead; anything neither list knows is caught
    by ``check_head`` at the first forward. Calls go through the head module, so ZeRO-3's hooks gather its
    weight as in the model's own forward.
    """
    model = causal_lm(forward)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in _HEAD_SCALES:
        value = getattr(model, name, None) if name == "logit_scale" else None
        value = getattr(config, name, value)
        if value is not None and not (isinstance(value, (int, float)) and value == 1):
            raise HeadError(
                f"{type(model).__name__} changes its LM head's output ({name}={value!r}), so the head cannot run "
                f"on its own at the loss positions: set training.head_at_loss_positions=false (and "
                f"training.head_chunk_tokens=0) to take the model's own logits"
            )
    head = model.get_output_embeddings()
    cap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    if not cap:
        return head

    def capped(hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(hidden) / cap) * cap

    return capped


class HeadError(ValueError):
    """The LM head cannot be computed apart from the model's forward for this model."""


@torch.no_grad()
def check_head(forward: Callable[..., Any], hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """Once per model: ``lm_head`` on the final hidden states of one position must give the logits the model's
    forward returned there, else the model does something after its head that ``lm_head`` does not know.

    Costs one head row per row of the first forward. Under ZeRO-3 every rank checks at its first forward, so
    the ranks still call the head module equally often.
    """
    model = causal_lm(forward)
    if getattr(model, "_pettingflow_head_checked", False):
        return
    mine = lm_head(forward)(hidden).float()
    theirs = logits.float()
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-2):
        worst = (mine - theirs).abs().max().item() if mine.shape == theirs.shape else float("nan")
        raise HeadError(
            f"{type(model).__name__}'s forward returns logits that differ from its LM head applied to its final "
            f"hidden states (largest difference {worst:.3g}; shapes {tuple(theirs.shape)} vs {tuple(mine.shape)}): "
            f"it transforms them after the head. Set training.head_at_loss_positions=false (and "
            f"training.head_chunk_tokens=0) to take the model's own logits"
        )
    model._pettingflow_head_checked = True


def _response_positions(
    forward: Callable[..., Any],
    mb: MicroBatch,
    share_prompts: bool,
    take: Callable[[Any, int], torch.Tensor],
    head_positions: int | None = None,
    hidden_states: bool = False,
) -> torch.Tensor:
    """The per-position outputs ``take(out, logits_to_keep)`` (logits or hidden states, ``[B, T, D]``) of the
    forwards of ``response_logits``, at the loss-mask positions, as ``[N, D]``. ``head_positions``: the
    ``logits_to_keep`` passed to the model instead of the one wanted (1: the head runs on one position only).
    ``hidden_states``: the forwards also return their hidden states (``output_hidden_states``)."""
    forward = functools.partial(forward, output_hidden_states=True) if hidden_states else forward

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
    """``(log-prob of each target, entropy)``, both ``[N]`` fp32, from ``[N, H]`` final hidden states, ``chunk_tokens``
    rows at a time.

    Each chunk's logits, log-softmax and entropy live only while that chunk is computed: under autograd the
    chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant), so its backward recomputes the chunk's
    logits from the saved hidden states instead of keeping ``N x V`` logits and log-softmax for the whole
    micro-batch. Cost: one more LM-head matmul per chunk in the backward pass. The values and gradients equal
    the unchunked computation up to float rounding (the tests check both). The entropy carries gradient only
    with ``entropy_grad`` (``entropy_coef > 0``); otherwise it is the metric, from the log-probs' own pass over
    the vocabulary (``head_outputs``).

    ``agree(n)``: the number of chunks every rank runs, given this rank's ``n`` (the worker passes the max over
    ranks under ZeRO-3, where each call of the head module gathers its weight with a collective, so all ranks
    must call it equally often: a rank with fewer tokens runs empty chunks, which still take part in the
    forward and the backward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head = lm_head(forward)

    def compute(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return head_outputs(head(h), t, entropy_grad)

    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    chunks = max(1, -(-hidden.shape[0] // chunk_tokens))  # a filler's 0 tokens too: the loss needs a graph
    if agree is not None:
        chunks = agree(chunks)
    for lo in range(0, chunks * chunk_tokens, chunk_tokens):
        h, t = hidden[lo : lo + chunk_tokens], targets[lo : lo + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            logp, entropy = checkpoint(compute, h, t, use_reentrant=False)
        else:
            logp, entropy = compute(h, t)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def scatter_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` tensor holding ``values`` (one per ``mask != 0`` position, row-major) and 0 elsewhere.

    The vocabulary-sized softmax is the costliest part after the transformer itself; prompt, env-token and
    padding columns never need it, so per-token quantities are computed on the valid positions only.
    """
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask != 0, values)


def head_outputs(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, entropy)`` of ``[N, V]`` logits, fp32: the entropy carries gradient only with ``entropy_grad``
    (an entropy bonus, ``entropy_coef > 0``); else it is the metric from the log-probs' own pass."""
    if entropy_grad:
        return token_logprobs(logits, targets), entropy_from_logits(logits.float())
    return token_logprobs_and_entropy(logits, targets)


def response_logprobs(
    forward: Callable[..., Any],
    mb: MicroBatch,
    share_prompts: bool = True,
    head_chunk_tokens: int | None = 0,
    entropy_grad: bool = False,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob, entropy)`` of each loss-mask token of ``mb`` (``[N]`` each, row-major) under ``forward``.

    ``head_chunk_tokens``: ``0`` the LM head at the loss positions only, all at once (the default); ``> 0`` the same
    in checkpointed chunks of that many tokens (``chunked_head``); ``None`` the logits of the model's own forward
    over the response window (``response_logits``: for models whose head ``lm_head`` cannot reproduce).
    ``agree``: see ``chunked_head``.
    """
    targets = mb.targets[mb.loss_mask != 0]
    if head_chunk_tokens is None:
        return head_outputs(response_logits(forward, mb, share_prompts), targets, entropy_grad)
    hidden = response_hidden(forward, mb, share_prompts)
    if head_chunk_tokens:
        return chunked_head(forward, hidden, targets, head_chunk_tokens, entropy_grad=entropy_grad, agree=agree)
    return head_outputs(lm_head(forward)(hidden), targets, entropy_grad)


@torch.no_grad()
def micro_batch_logprobs(
    forward: Callable[..., Any],
    mb: MicroBatch,
    share_prompts: bool = True,
    head_chunk_tokens: int | None = 0,
    agree: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """Log-probs of ``mb.targets`` under ``forward`` (no gradient); 0 outside the loss mask.
    ``head_chunk_tokens``, ``agree``: see ``response_logprobs``."""
    logp, _ = response_logprobs(forward, mb, share_prompts, head_chunk_tokens, agree=agree)
    return scatter_valid(logp, mb.loss_mask)


def micro_batch_loss(
    forward: Callable[..., Any],
    mb: MicroBatch,
    algo: AlgorithmSettings,
    *,
    old_is_current: bool = False,
    share_prompts: bool = True,
    denominator: float | None = None,
    head_chunk_tokens: int | None = 0,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (``total_loss``, with ``algo.policy_loss``) with the current policy's log-probs.

    Needs ``mb.old_logprobs`` (and ``mb.ref_logprobs`` when ``kl_coef > 0``), unless ``old_is_current``: no optimizer
    step has happened yet in this update, so the old log-probs (those of the weights the update started
    from) equal the current ones and are taken from this forward, detached, instead of a separate one
    (ratio 1; TRL does the same with one iteration per generation batch).
    Entropy is always reported (over the model tokens only); it carries gradient only when
    ``entropy_coef > 0``. Metrics also get ``logprob_mean`` (mean current log-prob of the model tokens),
    ``model_tokens`` and, with ``old_is_current``, ``sampler_abs_diff_sum`` (sum of |current - sampler|).
    ``share_prompts``: see ``response_logits``. ``denominator``: the loss denominator of the whole mini-batch
    (``data.Window.denominator``); the loss is then this micro-batch's share of it (``rl.losses.masked_aggregate``).
    ``head_chunk_tokens``: where the LM head runs (``response_logprobs``). ``agree``: makes the ranks run the same
    number of chunks (``chunked_head``).
    """
    if mb.old_logprobs is None and not old_is_current:
        raise ValueError("micro-batch has no old log-probs; compute them before training")
    if algo.kl_coef > 0 and mb.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs on the micro-batch")
    valid = mb.loss_mask != 0
    token_logp, token_entropy = response_logprobs(
        forward, mb, share_prompts, head_chunk_tokens, entropy_grad=algo.entropy_coef > 0, agree=agree
    )
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
        policy_loss_name=algo.policy_loss,
    )
    n = int(valid.sum())
    metrics["logprob_mean"] = float(logp.detach().sum() / max(n, 1))
    metrics["model_tokens"] = float(n)
    if old_is_current:
        metrics["sampler_abs_diff_sum"] = float((old - mb.sampler_logprobs).abs()[valid].sum())
    return loss, metrics
