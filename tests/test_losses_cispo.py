"""The second policy loss, CISPO (MiniMax-M1, arXiv 2506.13585), selected by name through ``POLICY_LOSSES``.

Checked against a plain per-token loop written from the paper's formula, value and gradient; the default
``ppo_clip`` is checked against the same kind of loop so the registry did not change today's loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.rl import POLICY_LOSSES, total_loss
from pettingflow.rl.loss_terms import ClipParams, PolicyLossTerms

LOW, HIGH = 0.2, 0.28


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip too
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).clone()
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.float64)
    return logp, old, adv, mask


def _cispo_reference(logp, old, adv, mask) -> tuple[float, list[list[float]]]:
    """token-mean of ``-clip(r) * A * logp`` and its gradient per token ``-clip(r) * A`` (0 at masked tokens)."""
    total, count, grad = 0.0, 0, [[0.0] * logp.shape[1] for _ in range(logp.shape[0])]
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            r = math.exp(float(logp[b, t]) - float(old[b, t]))
            w = min(max(r, 1 - LOW), 1 + HIGH)
            total += -w * float(adv[b, t]) * float(logp[b, t])
            grad[b][t] = -w * float(adv[b, t])
            count += 1
    n = count
    return total / n, [[g / n for g in row] for row in grad]


def _ppo_reference(logp, old, adv, mask) -> float:
    total, count = 0.0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            r, a = math.exp(float(logp[b, t]) - float(old[b, t])), float(adv[b, t])
            total += max(-a * r, -a * min(max(r, 1 - LOW), 1 + HIGH))
            count += 1
    return total / count


def test_cispo_matches_a_per_token_loop_in_value_and_gradient() -> None:
    logp, old, adv, mask = _batch()
    logp.requires_grad_(True)
    loss, metrics = total_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, policy_loss_name="cispo")
    loss.backward()
    want, want_grad = _cispo_reference(logp.detach(), old, adv, mask)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    ratio = (logp.detach() - old).exp()[mask != 0]
    outside = ((ratio < 1 - LOW) | (ratio > 1 + HIGH)).double().mean()
    assert 0 < float(outside) < 1, "the batch must have clipped and unclipped tokens to test both"
    assert metrics["clip_fraction"] == pytest.approx(float(outside))
    assert metrics["dual_clip_fraction"] == 0.0


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it() -> None:
    """The point of CISPO: a token whose ratio is out of the clip still gets gradient (bounded weight)."""
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)  # ratio e (clipped) and 1
    adv, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    grads = {}
    for name in ("ppo_clip", "cispo"):
        logp.grad = None
        loss, _ = total_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, policy_loss_name=name)
        loss.backward()
        grads[name] = logp.grad.clone()
    assert grads["ppo_clip"][0, 0] == 0.0 and grads["ppo_clip"][0, 1] == pytest.approx(-0.5)
    assert grads["cispo"][0].tolist() == pytest.approx([-(1 + HIGH) / 2, -0.5])


def test_the_default_policy_loss_is_ppo_clip_and_matches_its_loop() -> None:
    assert AlgorithmSettings().policy_loss == "ppo_clip"
    logp, old, adv, mask = _batch(1)
    loss, _ = total_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    assert float(loss) == pytest.approx(_ppo_reference(logp, old, adv, mask), rel=1e-12)


def test_masked_positions_get_no_loss_and_no_gradient_even_when_non_finite() -> None:
    logp, old, adv, mask = _batch(2)
    logp = torch.where(mask != 0, logp, torch.tensor(float("nan"), dtype=torch.float64)).requires_grad_(True)
    old = torch.where(mask != 0, old, torch.tensor(float("inf"), dtype=torch.float64))
    loss, _ = total_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, policy_loss_name="cispo")
    loss.backward()
    assert torch.isfinite(loss) and bool((logp.grad[mask == 0] == 0).all())


def test_the_config_selects_a_loss_by_its_registered_name_only() -> None:
    assert AlgorithmSettings(policy_loss="cispo").policy_loss == "cispo"
    with pytest.raises(ValidationError, match="ppo_clip"):
        AlgorithmSettings(policy_loss="gspo")


def test_a_new_loss_is_one_decorated_function() -> None:
    """Registering a toy loss makes ``total_loss`` use it by name (the config reads the names at import)."""

    @POLICY_LOSSES.register("toy_reinforce")
    def toy(logprobs, old_logprobs, advantages, valid, clip: ClipParams) -> PolicyLossTerms:
        none = valid.logical_and(valid.logical_not())
        return PolicyLossTerms(-advantages * logprobs, none, none)

    try:
        logp, old, adv, mask = _batch(3)
        loss, metrics = total_loss(logp, old, adv, mask, policy_loss_name="toy_reinforce")
        want = float((-(adv * logp) * mask).sum() / mask.sum())
        assert float(loss) == pytest.approx(want, rel=1e-12) and metrics["clip_fraction"] == 0.0
    finally:
        POLICY_LOSSES.unregister("toy_reinforce")
