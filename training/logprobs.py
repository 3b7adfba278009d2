"""Log-probs and the PPO loss of one micro-batch under a model's forward (the inputs of ``rl.losses``).

The loss formula itself is ``pettingflow.rl.losses.total_loss`` (pure); this module runs the forward that
feeds it: a padded forward, or the shared-prompt forward where a GRPO group's prompt is computed once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.rl.losses import entropy_from_logits, entropy_metric, total_loss
from pettingflow.training.data import MicroBatch


def forward_logits(forward: Callable[..., Any], mb: MicroBatch) -> torch.Tensor:
    """``[B, W, V]`` float32 logits aligned with ``mb.targets`` (logits at position t predict token t+1)."""
    out = forward(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        logits_to_keep=mb.logits_to_keep,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    if logits.shape[1] != mb.targets.shape[1]:
        raise RuntimeError(f"logits cover {logits.shape[1]} positions, targets {mb.targets.shape[1]}")
    return logits.float()


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
    valid = mb.loss_mask != 0
    groups = [g for g in mb.prompt_groups if len(g) > 1] if share_prompts else []
    if not groups:
        return forward_logits(forward, mb)[valid]
    per_row: dict[int, torch.Tensor] = {}
    singles = sorted(set(range(mb.input_ids.shape[0])) - {b for g in groups for b in g})
    if singles:
        idx = torch.tensor(singles, device=mb.input_ids.device)
        out = forward(
            input_ids=mb.input_ids[idx],
            attention_mask=mb.attention_mask[idx],
            logits_to_keep=mb.logits_to_keep,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :].float()
        for k, b in enumerate(singles):
            per_row[b] = logits[k][valid[b]]
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
        cache = prompt.past_key_values
        cache.batch_repeat_interleave(len(group))
        idx = torch.tensor(group, device=mb.input_ids.device)
        positions = torch.arange(P, P + R, device=mb.input_ids.device).unsqueeze(0).expand(len(group), -1)
        out = forward(
            input_ids=mb.input_ids[idx, P : P + R],
            attention_mask=mb.attention_mask[idx, : P + R],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        # response token j is predicted by the prompt's last logit (j = 0) or the response logit j - 1
        first = prompt.logits[:, -1:, :].float().expand(len(group), -1, -1)
        logits = torch.cat([first, out.logits[:, : R - 1, :].float()], dim=1)  # [n, R, V]
        for k, b in enumerate(group):
            lo = P - 1 - mb.start  # column of response token 0
            per_row[b] = logits[k][valid[b, lo : lo + R]]
    return torch.cat([per_row[b] for b in range(mb.input_ids.shape[0])], dim=0)


def scatter_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` tensor holding ``values`` (one per ``mask != 0`` position, row-major) and 0 elsewhere.

    The vocabulary-sized softmax is the costliest part after the transformer itself; prompt, env-token and
    padding columns never need it, so per-token quantities are computed on the valid positions only.
    """
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask != 0, values)


@torch.no_grad()
def micro_batch_logprobs(forward: Callable[..., Any], mb: MicroBatch, share_prompts: bool = True) -> torch.Tensor:
    """Log-probs of ``mb.targets`` under ``forward`` (no gradient); 0 outside the loss mask."""
    logits = response_logits(forward, mb, share_prompts)
    return scatter_valid(token_logprobs(logits, mb.targets[mb.loss_mask != 0]), mb.loss_mask)


def micro_batch_loss(
    forward: Callable[..., Any],
    mb: MicroBatch,
    algo: AlgorithmSettings,
    *,
    old_is_current: bool = False,
    share_prompts: bool = True,
    denominator: float | None = None,
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
    """
    if mb.old_logprobs is None and not old_is_current:
        raise ValueError("micro-batch has no old log-probs; compute them before training")
    if algo.kl_coef > 0 and mb.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs on the micro-batch")
    valid = mb.loss_mask != 0
    logits = response_logits(forward, mb, share_prompts)
    logp = scatter_valid(token_logprobs(logits, mb.targets[valid]), mb.loss_mask)
    if algo.entropy_coef > 0:
        entropy = scatter_valid(entropy_from_logits(logits), mb.loss_mask)
    else:
        entropy = scatter_valid(entropy_metric(logits), mb.loss_mask)
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
