"""The loss parts the config selects by name: policy losses, KL estimators and loss aggregation modes.

Each is one decorated function (or class) in a ``Registry``; ``rl/losses.py`` does the masking and the sum
(``total_loss``). They are written with tensor *methods* only (``x.exp()``, ``x.clamp(...)``), so this module
imports no torch: ``configs/settings.py`` reads the allowed names from these registries and a config still loads
without torch (tests/test_architecture.py). Every input arrives with its masked positions already 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from pettingflow.rl.registry import Registry

if TYPE_CHECKING:
    import torch

LOG_RATIO_CLAMP = 20.0  # |log p - log q| is clamped before exp, as in verl, so exp() never overflows
K3_MAX = 10.0  # verl's low_var_kl clamps each token's k3 value to at most 10


class ClipParams(NamedTuple):
    """The ratio bounds of ``AlgorithmSettings`` a policy loss may use (validated by ``rl.losses.policy_loss``)."""

    low: float  # clip_ratio_low: the ratio is bounded below by 1 - low
    high: float  # clip_ratio_high: ... and above by 1 + high
    dual: float | None  # clip_ratio_c: dual-clip bound for negative advantages, None: off


class PolicyLossTerms(NamedTuple):
    """What a policy loss returns: the per-token loss ``[B, T]`` (aggregated by ``loss_agg_mode`` afterwards), and
    the bool ``[B, T]`` tokens where its clip / dual clip is active (reported as ``clip_fraction`` and
    ``dual_clip_fraction``)."""

    per_token: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


class PolicyLoss(Protocol):
    """``(logprobs, old_logprobs, advantages, valid, clip) -> PolicyLossTerms``, all ``[B, T]``.

    ``old_logprobs`` and ``advantages`` are detached, and all three are 0 where ``valid`` (bool) is False;
    ``log_ratio(logprobs, old_logprobs)`` is the clamped log importance ratio every loss should start from.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        valid: torch.Tensor,
        clip: ClipParams,
    ) -> PolicyLossTerms: ...


class LossAggMode(Protocol):
    """A ``loss_agg_mode``: ``numerator(values, tokens) / max(count(tokens), 1)``, or the numerator over a given
    denominator. ``values`` is ``[B, T]`` with masked positions already 0; ``tokens`` is ``[B]`` (int64), each
    row's count of mask-1 tokens. ``count`` also serves ``loss_denominator``, so a mini-batch's denominator and
    a batch's own aggregate always agree."""

    @staticmethod
    def numerator(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def count(tokens: torch.Tensor) -> torch.Tensor: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "algorithm.policy_loss")
LOSS_AGG_MODES: Registry[type[LossAggMode]] = Registry("loss_agg_mode", "algorithm.loss_agg_mode")
# d = logprobs - ref_logprobs (per token) -> the KL estimate per token
KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("kl_estimator", "algorithm.kl_estimator")


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``log(pi / pi_old)`` per token, clamped to ±20 so ``exp`` never overflows (as verl does)."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    clip: ClipParams,
) -> PolicyLossTerms:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip and optional dual clip.

    ``L = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high))`` (asymmetric "clip-higher": DAPO, Yu et al.
    2025). Dual clip (Ye et al. 2020, as in verl): where ``A < 0``, ``L = min(L, -A * dual)``, bounding the loss
    of very large ratios. ``clipped``: the clipped term is strictly larger, so the token's gradient is 0.
    """
    ratio = log_ratio(logprobs, old_logprobs).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = unclipped.maximum(clipped)
    clip_active = clipped > unclipped
    dual_active = valid.logical_and(valid.logical_not())  # all False, shaped and placed like valid
    if clip.dual is not None:
        bound = -advantages * clip.dual
        dual_active = (advantages < 0).logical_and(per_token > bound)
        per_token = bound.where(dual_active, per_token)
    return PolicyLossTerms(per_token, clip_active, dual_active)


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    clip: ClipParams,
) -> PolicyLossTerms:
    """CISPO: clipped importance-sampling weights, REINFORCE-style (MiniMax-M1, arXiv 2506.13585, eq. 4-5).

    ``L = -sg(clamp(ratio, 1 - low, 1 + high)) * A * logp``: the importance weight is clipped and detached
    (``sg``: stop-gradient), so unlike PPO's clip no token loses its gradient; a clipped weight only bounds how
    much a token counts. The gradient per token is ``-clamp(ratio, ...) * A * d logp``. ``clipped``: tokens
    whose weight was clipped (their ratio is outside the bounds). The dual clip does not apply (no dual tokens).
    The paper aggregates with ``token-mean`` (``algorithm.loss_agg_mode``'s default).
    """
    ratio = log_ratio(logprobs, old_logprobs).exp().detach()
    weight = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = -(weight * advantages) * logprobs
    clip_active = (ratio < 1.0 - clip.low).logical_or(ratio > 1.0 + clip.high).logical_and(valid)
    return PolicyLossTerms(per_token, clip_active, valid.logical_and(valid.logical_not()))


# ----------------------------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020, "Approximating KL Divergence"): d = logp - ref_logp
# ----------------------------------------------------------------------------------------------------------------
@KL_ESTIMATORS.register("k1")
def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


@KL_ESTIMATORS.register("k2")
def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


@KL_ESTIMATORS.register("k3")
def _k3(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return ((-d).exp() + d - 1.0).clamp(max=K3_MAX)


# ----------------------------------------------------------------------------------------------------------------
# loss aggregation modes
# ----------------------------------------------------------------------------------------------------------------
@LOSS_AGG_MODES.register("token-mean")
class _TokenMean:
    @staticmethod
    def numerator(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return values.sum()

    @staticmethod
    def count(tokens: torch.Tensor) -> torch.Tensor:
        return tokens.sum()


@LOSS_AGG_MODES.register("seq-mean-token-sum")
class _SeqMeanTokenSum:
    @staticmethod
    def numerator(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return values.sum(dim=-1).sum()

    @staticmethod
    def count(tokens: torch.Tensor) -> torch.Tensor:
        return (tokens > 0).sum()  # sequences without a token do not count


@LOSS_AGG_MODES.register("seq-mean-token-mean")
class _SeqMeanTokenMean:
    @staticmethod
    def numerator(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (values.sum(dim=-1) / tokens.clamp(min=1)).sum()

    @staticmethod
    def count(tokens: torch.Tensor) -> torch.Tensor:
        return (tokens > 0).sum()
