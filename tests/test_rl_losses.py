"""Masked PPO/GRPO losses: exact masking, hand-computed values, clipping, KL, entropy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pettingflow.rl import (
    entropy_from_logits,
    kl_penalty,
    loss_denominator,
    masked_aggregate,
    policy_loss,
    total_loss,
)

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
INF, NAN = float("inf"), float("nan")


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 7 / 3), ("seq-mean-token-sum", (3 + 4) / 2), ("seq-mean-token-mean", (1.5 + 4) / 2)],
)
def test_masked_aggregate_hand_computed(mode: str, expected: float) -> None:
    values = t([[1, 2, 3], [4, 5, 6], [100, 100, 100]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the all-masked row counts in no mean
    assert masked_aggregate(values, mask, mode).item() == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_masked_aggregate_all_zero_mask_is_zero_with_grad(mode: str) -> None:
    values = t([[INF, NAN], [1.0, 2.0]]).requires_grad_()
    out = masked_aggregate(values, torch.zeros(2, 2), mode)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 2, dtype=F64))


def test_masked_aggregate_validates() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        masked_aggregate(torch.zeros(1, 2), torch.ones(1, 2), "mean")
    with pytest.raises(ValueError, match=r"values has shape \(1, 3\) but mask has shape \(1, 2\)"):
        masked_aggregate(torch.zeros(1, 3), torch.ones(1, 2), "token-mean")
    with pytest.raises(ValueError, match="mask must be 2-D"):
        masked_aggregate(torch.zeros(2), torch.ones(2), "token-mean")
    with pytest.raises(ValueError, match="only 0 and 1"):
        masked_aggregate(torch.zeros(1, 2), torch.tensor([[1.0, 0.5]]), "token-mean")


# ---------------------------------------------------------------- policy loss


def hand_batch() -> dict[str, torch.Tensor]:
    """Row 0: [A=1 ratio 1, A=1 ratio 1.5, masked]; row 1: [A=-1 ratio .5, A=-2 ratio 1.1, A=.5 ratio 1]."""
    old = t([[-1.0, -2.0, -3.0], [-1.5, -0.5, -2.5]])
    ratios = t([[1.0, 1.5, 7.0], [0.5, 1.1, 1.0]])
    return {
        "logprobs": old + ratios.log(),
        "old_logprobs": old,
        "advantages": t([[1.0, 1.0, 5.0], [-1.0, -2.0, 0.5]]),
        "mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
    }


# per-token losses with clip [0.8, 1.28]: -1, -1.28 (clipped), 0.8 (clipped), 2.2, -0.5
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (-1 - 1.28 + 0.8 + 2.2 - 0.5) / 5),
        ("seq-mean-token-sum", ((-1 - 1.28) + (0.8 + 2.2 - 0.5)) / 2),
        ("seq-mean-token-mean", ((-1 - 1.28) / 2 + (0.8 + 2.2 - 0.5) / 3) / 2),
    ],
)
def test_policy_loss_hand_computed(mode: str, expected: float) -> None:
    loss, metrics = policy_loss(**hand_batch(), clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["pg_loss"] == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["dual_clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5 + 1.1 + 1) / 5)
    k3 = [r - 1 - math.log(r) for r in (1, 1.5, 0.5, 1.1, 1)]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 5)
    assert all(type(v) is float for v in metrics.values())


def test_clipped_side_has_zero_gradient_and_unclipped_side_keeps_it() -> None:
    # A>0 & ratio>1+high: clipped.  A<0 & ratio<1-low: clipped.  A>0 & ratio<1-low and A<0 & ratio>1+high:
    # PPO's pessimistic min keeps the unclipped term, so the gradient is -A * ratio / n_tokens.
    adv = t([[1.0, -1.0, 1.0, -1.0]])
    ratios = t([[1.5, 0.5, 0.5, 1.5]])
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    logprobs = (old + ratios.log()).requires_grad_()
    loss, metrics = policy_loss(logprobs, old, adv, torch.ones(1, 4), 0.2, 0.28)
    loss.backward()
    expected = t([[0.0, 0.0, -1.0 * 0.5 / 4, 1.0 * 1.5 / 4]])
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=0)
    assert metrics["clip_fraction"] == 0.5


def test_asymmetric_clip_bounds() -> None:
    old = t([[0.0, 0.0]])
    ratios = t([[1.25, 1.25]])  # inside 1 + 0.28, outside 1 + 0.2
    adv = t([[1.0, 1.0]])
    loss, m = policy_loss(old + ratios.log(), old, adv, torch.ones(1, 2), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.25) and m["clip_fraction"] == 0.0
    loss, m = policy_loss(old + ratios.log(), old, adv, torch.ones(1, 2), 0.2, 0.2)
    assert loss.item() == pytest.approx(-1.2) and m["clip_fraction"] == 1.0


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # tokens: A=-1 ratio 5 (dual-clipped to 3), A=-1 ratio 2 (below c: loss 2), A=+1 ratio 5 (upper clip -1.28)
    adv = t([[-1.0, -1.0, 1.0]])
    old = t([[-2.0, -2.0, -2.0]])
    logprobs = (old + t([[5.0, 2.0, 5.0]]).log()).requires_grad_()
    mask = torch.ones(1, 3)
    plain, m0 = policy_loss(logprobs, old, adv, mask, 0.2, 0.28, None, "seq-mean-token-sum")
    assert plain.item() == pytest.approx(5.0 + 2.0 - 1.28) and m0["dual_clip_fraction"] == 0.0
    loss, m = policy_loss(logprobs, old, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.28)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[0.0, 2.0, 0.0]]), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"clip_ratio_low": 1.0}, ValueError, r"clip_ratio_low must be in \[0, 1\), got 1.0"),
        ({"clip_ratio_high": -0.1}, ValueError, "clip_ratio_high must be >= 0"),
        ({"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c .* must be > 1"),
        ({"loss_agg_mode": "sum"}, ValueError, "unknown loss_agg_mode"),
        ({"advantages": t([1.0, 2.0])}, ValueError, r"advantages has shape \(2,\)"),
        ({"old_logprobs": torch.zeros(2, 2, dtype=torch.long)}, TypeError, "old_logprobs must be a floating"),
    ],
)
def test_policy_loss_validates(kwargs: dict, error: type[Exception], text: str) -> None:
    args = {
        "logprobs": torch.zeros(2, 2),
        "old_logprobs": torch.zeros(2, 2),
        "advantages": torch.zeros(2, 2),
        "mask": torch.ones(2, 2),
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
    } | kwargs
    with pytest.raises(error, match=text):
        policy_loss(**args)


# ---------------------------------------------------------------- KL and entropy


def test_kl_estimators_hand_computed() -> None:
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    d = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d, rel=1e-15)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d, rel=1e-15)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + d - 1, rel=1e-12)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_k3_is_clamped_and_finite() -> None:
    logp = t([-40.0, 40.0, 5.0, 0.0]).requires_grad_()
    out = kl_penalty(logp, t([0.0, 0.0, 0.0, 0.0]), "k3")
    assert out.tolist() == [10.0, 10.0, pytest.approx(math.exp(-5) + 5 - 1, rel=1e-15), 0.0]
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[2].item() == pytest.approx(1 - math.exp(-5), rel=1e-12)  # d/dlogp k3 = 1 - exp(-d)
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'"):
        kl_penalty(t([0.0]), t([0.0]), "k4")
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(t([0.0]), t([0.0, 1.0]), "k1")


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_k3_are_unbiased_estimates_of_kl_pi_to_ref(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    true_kl = float((p * (p / q).log()).sum())  # KL(pi || ref), samples drawn from pi
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = kl_penalty(p.log()[samples], q.log()[samples], estimator).mean().item()
    assert estimate == pytest.approx(true_kl, abs=0.005)


def test_entropy_from_logits() -> None:
    assert entropy_from_logits(torch.zeros(2, 3, 8, dtype=F64)).sub(math.log(8)).abs().max().item() < 1e-12
    logits = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(1), dtype=F64)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected, rtol=1e-12, atol=1e-12)
    peaked = t([[0.0, -INF, -INF]]).requires_grad_()
    h = entropy_from_logits(peaked)
    assert h.item() == 0.0
    h.sum().backward()
    assert torch.isfinite(peaked.grad).all()
    with pytest.raises(ValueError, match="non-empty last"):
        entropy_from_logits(torch.zeros(2, 0))


# ---------------------------------------------------------------- total loss and exact masking (T3)


def model_batch(seed: int, B: int = 3, T: int = 6, V: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=F64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]])[:B, :T]
    return {
        "logits": logits,
        "ids": ids,
        "mask": mask,
        "noise_old": 0.3 * torch.randn(B, T, generator=gen, dtype=F64),
        "noise_ref": 0.3 * torch.randn(B, T, generator=gen, dtype=F64),
        "adv": torch.randn(B, 1, generator=gen, dtype=F64).expand(B, T).contiguous(),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [[1, 2], [2, 1], [1, 1, 1]])
def test_shares_with_the_mini_batch_denominator_add_up_to_the_whole(mode: str, split: list[int]) -> None:
    """Micro-batches (any split of the rows, as ranks and micro-batches cut a mini-batch) divided by the whole
    mini-batch's denominator: their losses and gradients add up to the mini-batch's own, and the metrics stay
    each micro-batch's own means."""
    b = model_batch(1)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]])
    logprobs = torch.log_softmax(b["logits"], -1).gather(-1, b["ids"].unsqueeze(-1)).squeeze(-1)
    kwargs = dict(kl_coef=0.1, loss_agg_mode=mode)
    old, ref = logprobs.detach() + b["noise_old"], logprobs.detach() + b["noise_ref"]
    whole, _ = total_loss(logprobs, old, b["adv"], mask, ref_logprobs=ref, **kwargs)
    (whole_grad,) = torch.autograd.grad(whole, b["logits"], retain_graph=True)
    bounds = torch.tensor([0, *split]).cumsum(0).tolist()
    parts = [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    denominator = loss_denominator((mask != 0).sum(dim=-1).tolist(), mode)
    assert denominator == (9.0 if mode == "token-mean" else 3.0)
    total = 0.0
    for p in parts:
        args = (logprobs[p], old[p], b["adv"][p], mask[p])
        share, metrics = total_loss(*args, ref_logprobs=ref[p], denominator=denominator, **kwargs)
        _, alone_metrics = total_loss(*args, ref_logprobs=ref[p], **kwargs)
        assert metrics == pytest.approx(alone_metrics, rel=1e-12)
        total = total + share
    (grad,) = torch.autograd.grad(total, b["logits"])
    assert float(total) == pytest.approx(float(whole), rel=1e-12)
    assert torch.allclose(grad, whole_grad, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="denominator"):
        masked_aggregate(logprobs, mask, mode, denominator=0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_gradient_is_exactly_zero_at_masked_positions(mode: str, kl_estimator: str, clip_ratio_c: float | None) -> None:
    b = model_batch(0)
    logprobs = torch.log_softmax(b["logits"], -1).gather(-1, b["ids"].unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(b["logits"])
    loss, _ = total_loss(
        logprobs,
        logprobs.detach() + b["noise_old"],
        b["adv"],
        b["mask"],
        ref_logprobs=logprobs.detach() + b["noise_ref"],
        entropy=entropy,
        clip_ratio_c=clip_ratio_c,
        kl_coef=0.1,
        kl_estimator=kl_estimator,
        entropy_coef=0.01,
        loss_agg_mode=mode,
    )
    loss.backward()
    grad = b["logits"].grad
    masked = b["mask"] == 0
    assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))  # exactly 0, policy + KL + entropy
    assert (grad[~masked].abs().sum(-1) > 0).all()  # every model token does get gradient


@pytest.mark.parametrize("mode", MODES)
def test_garbage_at_masked_positions_changes_nothing(mode: str) -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    gen = torch.Generator().manual_seed(3)
    clean = {k: torch.randn(2, 4, generator=gen, dtype=F64) for k in ("lp", "old", "adv", "ref", "ent")}
    dirty = {k: torch.where(mask.bool(), v, t([[INF, NAN, -INF, 1e30]] * 2)) for k, v in clean.items()}
    results = []
    for data in (clean, dirty):
        lp, ent = data["lp"].clone().requires_grad_(), data["ent"].clone().requires_grad_()
        loss, metrics = total_loss(
            lp, data["old"], data["adv"], mask, ref_logprobs=data["ref"], entropy=ent,
            kl_coef=0.2, entropy_coef=0.05, clip_ratio_c=3.0, loss_agg_mode=mode,
        )  # fmt: skip
        loss.backward()
        results.append((loss.detach(), metrics, lp.grad, ent.grad))
    (l0, m0, g0, e0), (l1, m1, g1, e1) = results
    assert torch.isfinite(l1) and torch.equal(l0, l1) and m0 == m1
    assert torch.equal(g0, g1) and torch.equal(e0, e1)
    assert torch.equal(g1[mask == 0], torch.zeros(4, dtype=F64))


def test_masked_loss_equals_loss_on_the_valid_tokens_only() -> None:
    gen = torch.Generator().manual_seed(4)
    lp, old, adv, ref = (torch.randn(1, 5, generator=gen, dtype=F64) for _ in range(4))
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    keep = mask[0].bool()
    full, _ = total_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    only, _ = total_loss(
        lp[:, keep], old[:, keep], adv[:, keep], torch.ones(1, 3), ref_logprobs=ref[:, keep], kl_coef=0.1
    )
    assert full.item() == pytest.approx(only.item(), rel=1e-14)


def test_total_loss_combines_terms() -> None:
    b = hand_batch()
    ref = b["old_logprobs"] - 0.1
    ent = t([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]])
    loss, m = total_loss(**b, ref_logprobs=ref, entropy=ent, kl_coef=0.5, kl_estimator="k2", entropy_coef=0.1)
    assert m["entropy"] == pytest.approx((1 + 2 + 0.5 * 3) / 5)
    assert m["loss"] == pytest.approx(m["pg_loss"] + 0.5 * m["kl"] - 0.1 * m["entropy"], rel=1e-12)
    assert loss.item() == m["loss"]
    d = (b["logprobs"] - ref)[b["mask"].bool()]
    assert m["kl"] == pytest.approx(float((0.5 * d**2).mean()), rel=1e-12)
    # with zero coefficients the terms are reported but not added
    _, m0 = total_loss(**b, ref_logprobs=ref, entropy=ent)
    assert m0["loss"] == m0["pg_loss"] and "kl" in m0 and "entropy" in m0
    _, bare = total_loss(**b)
    assert set(bare) == {"pg_loss", "clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean", "loss"}


def test_total_loss_validates() -> None:
    b = hand_batch()
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        total_loss(**b, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy"):
        total_loss(**b, entropy_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got -1"):
        total_loss(**b, kl_coef=-1.0, ref_logprobs=b["old_logprobs"])
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2, 2\)"):
        total_loss(**b, ref_logprobs=torch.zeros(2, 2))


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_mask_gives_zero_loss_and_finite_grads(mode: str) -> None:
    b = model_batch(5)
    logprobs = torch.log_softmax(b["logits"], -1).gather(-1, b["ids"].unsqueeze(-1)).squeeze(-1)
    loss, metrics = total_loss(
        logprobs, logprobs.detach() + b["noise_old"], b["adv"], torch.zeros(3, 6),
        ref_logprobs=logprobs.detach() + b["noise_ref"], entropy=entropy_from_logits(b["logits"]),
        kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=3.0, loss_agg_mode=mode,
    )  # fmt: skip
    assert loss.item() == 0.0
    assert all(v == 0.0 for v in metrics.values())
    loss.backward()
    assert torch.equal(b["logits"].grad, torch.zeros_like(b["logits"]))


# ---------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(MODES),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
    clip_ratio_c=st.sampled_from([None, 3.0]),
    fill=st.sampled_from([0.0, 1e4, -1e4, INF, NAN]),
)
def test_loss_is_finite_and_mask_invariant(
    B: int, T: int, seed: int, mode: str, kl_estimator: str, clip_ratio_c: float | None, fill: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) > 0.4).long()
    data = {k: 2 * torch.randn(B, T, generator=gen, dtype=F64) for k in ("lp", "old", "adv", "ref", "ent")}
    other = {k: torch.where(mask.bool(), v, torch.full_like(v, fill)) for k, v in data.items()}
    outs = []
    for d in (data, other):
        lp = d["lp"].clone().requires_grad_()
        loss, metrics = total_loss(
            lp, d["old"], d["adv"], mask, ref_logprobs=d["ref"], entropy=d["ent"], clip_ratio_c=clip_ratio_c,
            kl_coef=0.1, kl_estimator=kl_estimator, entropy_coef=0.01, loss_agg_mode=mode,
        )  # fmt: skip
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert all(math.isfinite(v) for v in metrics.values())
        assert torch.equal(lp.grad[mask == 0], torch.zeros_like(lp.grad[mask == 0]))
        outs.append((loss.detach(), lp.grad, metrics))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]
