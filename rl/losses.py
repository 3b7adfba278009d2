"""Policy-gradient token losses with response masks: the policy loss, KL penalty, entropy bonus.

The terms the config selects by name (``algorithm.policy_loss``, ``kl_estimator``, ``loss_agg_mode``) are
registered in ``rl/loss_terms.py``; this module masks, aggregates and adds them up.

All tensors are ``[B, T]`` (B samples, T response positions) unless stated; ``mask[b, t] = 1`` marks a
model token that gets gradient, 0 an observation/padding token. Masked positions are
replaced by 0 with ``torch.where`` *before* any arithmetic, so (a) garbage there (even inf/NaN) cannot
leak into the loss and (b) their gradient is exactly 0, not merely small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pettingflow.rl.loss_terms import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, ClipParams, log_ratio

__all__ = ["entropy_from_logits", "kl_penalty", "loss_denominator", "masked_aggregate", "policy_loss", "total_loss"]


def _valid(mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    """Check that ``mask`` is a 0/1 ``[B, T]`` tensor shaped like every tensor given; return ``mask != 0``."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but mask has shape {tuple(mask.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must contain only 0 and 1")
    return mask != 0


def _zero_masked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _token_mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    """Metric helper: mean over valid tokens as a python float (0.0 when there are none)."""
    values = _zero_masked(values.detach().float(), valid)
    return float(values.sum() / valid.sum().clamp(min=1))


def masked_aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | None = None
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar over tokens with ``mask == 1`` (``loss_agg_mode``).

    - ``token-mean``:          ``sum(v*m) / sum(m)`` (DAPO, Yu et al. 2025; verl default).
    - ``seq-mean-token-sum``:  mean over sequences with >= 1 token of ``sum_t v*m`` (Dr. GRPO).
    - ``seq-mean-token-mean``: mean over sequences with >= 1 token of ``sum_t v*m / sum_t m`` (GRPO paper).

    Denominators are clamped to >= 1, so an all-zero mask gives 0 (still attached to the graph,
    gradient 0), never NaN. Unlike verl, sequences without any token do not count in the seq means.

    ``denominator``: divide by this instead of the tokens (token-mean) or sequences (seq modes) of ``mask``:
    ``loss_denominator`` of the whole mini-batch a micro-batch belongs to. The micro-batch's value is then
    its share of the mini-batch's aggregate, and the shares of every micro-batch on every rank add up to it,
    however the mini-batch was split (world size changes speed, never the loss).
    """
    agg = LOSS_AGG_MODES.get(mode)
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    valid = _valid(mask, values=values)
    v = _zero_masked(values, valid)
    tokens = valid.sum(dim=-1)
    return agg.numerator(v, tokens) / (denominator if denominator is not None else agg.count(tokens).clamp(min=1))


def loss_denominator(tokens_per_row: Sequence[int], mode: str) -> float:
    """What ``masked_aggregate`` divides by over a whole mini-batch, from each row's count of mask-1 tokens:
    the tokens for ``token-mean``, the rows with >= 1 token for the seq modes; >= 1. Every rank computes it
    from the whole mini-batch, so no collective is needed."""
    agg = LOSS_AGG_MODES.get(mode)
    total = int(agg.count(torch.as_tensor(list(tokens_per_row), dtype=torch.int64)))
    return float(max(total, 1))


def _local_value(
    aggregate: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | None
) -> float:
    """The metric of one batch: its own mean, also when ``aggregate`` was divided by a mini-batch denominator."""
    if denominator is None:
        return float(aggregate.detach())
    return float(masked_aggregate(values.detach(), mask, mode))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
    policy_loss_name: str = "ppo_clip",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss registered as ``policy_loss_name`` in ``POLICY_LOSSES`` (default: PPO's clipped
    surrogate), masked and aggregated with ``loss_agg_mode``.

    ``old_logprobs`` and ``advantages`` are treated as constants (detached); every input is 0 at masked positions
    before the loss sees it. Metrics (means over valid tokens): ``clip_fraction`` (tokens where the loss's clip is
    active), ``dual_clip_fraction``, ``approx_kl`` (k3 estimate of KL(old || new): ``(ratio - 1) - log ratio``),
    ``ratio_mean``, plus ``pg_loss``.
    ``denominator``: see ``masked_aggregate`` (the loss is then a share; ``pg_loss`` stays this batch's mean).
    """
    fn = POLICY_LOSSES.get(policy_loss_name)
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or None, got {clip_ratio_c}")
    valid = _valid(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)

    logp = _zero_masked(logprobs, valid)
    old = _zero_masked(old_logprobs.detach(), valid)
    adv = _zero_masked(advantages.detach(), valid)
    terms = fn(logp, old, adv, valid, ClipParams(clip_ratio_low, clip_ratio_high, clip_ratio_c))
    if terms.per_token.shape != mask.shape:
        got, want = tuple(terms.per_token.shape), tuple(mask.shape)
        raise ValueError(f"policy loss {policy_loss_name!r} returned shape {got}, expected {want}")
    per_token = _zero_masked(terms.per_token, valid)
    ratio_log = log_ratio(logp, old).detach()
    ratio = torch.exp(ratio_log)

    agg = masked_aggregate(per_token, mask, loss_agg_mode, denominator)
    metrics = {
        "pg_loss": _local_value(agg, per_token, mask, loss_agg_mode, denominator),
        "clip_fraction": _token_mean(terms.clipped & valid, valid),
        "dual_clip_fraction": _token_mean(terms.dual_clipped & valid, valid),
        "approx_kl": _token_mean((ratio - 1.0) - ratio_log, valid),
        "ratio_mean": _token_mean(ratio, valid),
    }
    return agg, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

    With ``d = logp - ref_logp``: ``k1 = d``; ``k2 = d**2 / 2``; ``k3 = exp(-d) + d - 1`` (unbiased,
    low variance, >= 0). For k3, ``d`` is clamped to ±20 and the result to <= 10 (verl's ``low_var_kl``).
    ``ref_logprobs`` is treated as a constant (detached). No masking here: see ``total_loss``.
    """
    fn = KL_ESTIMATORS.get(estimator)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    return fn(logprobs - ref_logprobs.detach())


def _check_vocab_dim(logits: torch.Tensor) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got {tuple(logits.shape)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V] -> [...]``: ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)``.

    Vocabulary entries with ``p == 0`` (e.g. logits of -inf) contribute 0, with finite gradient.
    Computed in the logits' dtype: pass float32 logits for an accurate value.
    """
    _check_vocab_dim(logits)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)


def total_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
    policy_loss_name: str = "ppo_clip",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss = pg + kl_coef * agg(KL) - entropy_coef * agg(entropy)``, every term aggregated with
    ``loss_agg_mode`` over ``mask`` (as verl's actor does with ``use_kl_loss``); ``pg`` is the policy loss
    registered as ``policy_loss_name`` (``policy_loss``).

    ``entropy`` is the per-token entropy ``[B, T]`` (``entropy_from_logits``). ``ref_logprobs`` is
    required when ``kl_coef > 0`` and ``entropy`` when ``entropy_coef > 0``; when given with a zero
    coefficient they are only reported. Defaults equal ``AlgorithmSettings``' defaults.
    Metrics: ``policy_loss``'s, plus ``kl`` / ``entropy`` when computed, plus ``loss``.
    ``denominator`` (``masked_aggregate``): every term is this batch's share of its mini-batch's aggregate;
    the metrics stay this batch's own means.
    """
    for name, coef in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not (math.isfinite(coef) and coef >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy (per-token, see entropy_from_logits)")

    loss, metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        denominator,
        policy_loss_name,
    )
    local_loss = metrics["pg_loss"]
    valid = mask != 0
    if ref_logprobs is not None:
        _valid(mask, ref_logprobs=ref_logprobs)
        per_token_kl = kl_penalty(_zero_masked(logprobs, valid), _zero_masked(ref_logprobs, valid), kl_estimator)
        kl = masked_aggregate(per_token_kl, mask, loss_agg_mode, denominator)
        metrics["kl"] = _local_value(kl, per_token_kl, mask, loss_agg_mode, denominator)
        if kl_coef > 0:
            loss = loss + kl_coef * kl
            local_loss += kl_coef * metrics["kl"]
    if entropy is not None:
        ent = masked_aggregate(entropy, mask, loss_agg_mode, denominator)
        metrics["entropy"] = _local_value(ent, entropy, mask, loss_agg_mode, denominator)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent
            local_loss -= entropy_coef * metrics["entropy"]
    metrics["loss"] = float(loss.detach()) if denominator is None else local_loss
    return loss, metrics
