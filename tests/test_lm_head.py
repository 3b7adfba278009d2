"""The LM head at the loss positions and the token log-probs as gather minus a chunked logsumexp
(``training.logprobs``): equal to the plain formulas in value and gradient, without their fp32 copies, and
refused or checked where a model does something after its head."""

from __future__ import annotations

import pytest
import torch

from pettingflow.rl.losses import entropy_from_logits
from pettingflow.training.logprobs import (
    HeadError,
    check_head,
    lm_head,
    micro_batch_loss,
    response_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the update computed before: a full fp32 log-softmax, then the entropy from it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_logits(logits.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_token_logprobs_equal_the_log_softmax_in_value_and_gradient(dtype, rows):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50)).to(dtype)
    logits[0, 1, :10] = float("-inf")  # masked vocabulary entries: p = 0, no nan in the entropy or the gradient
    targets = torch.randint(10, 50, (2, 7))
    weights = torch.randn(2, 7)

    mine = logits.clone().requires_grad_()
    logp, entropy = token_logprobs_and_entropy(mine, targets, rows_per_chunk=rows)
    (logp * weights).sum().backward()
    theirs = logits.clone().requires_grad_()
    ref_logp, ref_entropy = reference(theirs, targets)
    (ref_logp * weights).sum().backward()

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == targets.shape
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert mine.grad.dtype == dtype and torch.isfinite(mine.grad).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=tol, atol=tol)
    assert not entropy.requires_grad
    torch.testing.assert_close(token_logprobs(logits, targets, rows), ref_logp.detach(), rtol=1e-5, atol=1e-5)


def test_token_logprobs_save_no_float32_copy_of_the_logits():
    """The backward keeps the bf16 logits and one fp32 number per row, nothing vocabulary-sized in fp32 (the
    plain formula saves its fp32 log-softmax: the check sees it)."""
    vocab = 1000
    logits = torch.randn(16, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (16,))

    def saved_fp32_vocab_tensors(fn) -> int:
        found = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float32 and t.shape[-1:] == (vocab,):
                found.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(logits, targets)
        return len(found)

    assert saved_fp32_vocab_tensors(lambda x, t: token_logprobs_and_entropy(x, t)[0].sum()) == 0
    assert saved_fp32_vocab_tensors(lambda x, t: reference(x, t)[0].sum()) > 0


def test_token_logprobs_refuse_bad_input():
    with pytest.raises(ValueError, match="do not match targets"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="rows_per_chunk must be >= 1"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), rows_per_chunk=0)
    with pytest.raises(ValueError, match="non-empty vocabulary"):
        token_logprobs(torch.zeros(3, 0), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ the head's guards
def tiny_model(kind: str, **extra):
    """A random 1-layer causal LM of ``kind`` with a 64-token vocabulary."""
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    config = getattr(transformers, f"{kind}Config")(**common, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{kind}ForCausalLM")(config).eval()


def micro_batch():
    import numpy as np

    from pettingflow.training.data import Sample, collate

    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 64, 6)
    samples = [
        Sample(
            row=i,
            agent_name="a",
            policy_name="p",
            lora_name=None,
            prompt_ids=prompt,
            response_ids=rng.integers(1, 64, n),
            response_mask=np.array([1, 1, 0, 1, 1, 1, 1][:n], np.int8),
            sampler_logprobs=np.full(n, -2.0, np.float32),
            advantage=a,
        )
        for i, (n, a) in enumerate([(5, 1.0), (7, -0.5), (6, 0.25)])
    ]
    return collate(samples)


def test_soft_capped_head_gives_the_models_own_logprobs_and_gradients():
    """Gemma 2 caps its logits (``cap * tanh(x / cap)``) after the head: ``lm_head`` does the same, so the
    loss-position head gives the log-probs, loss and gradients of the model's own logits (a cap small
    enough to matter for random weights)."""
    from pettingflow.configs.settings import AlgorithmSettings

    model = tiny_model("Gemma2", final_logit_softcapping=0.05)
    mb = micro_batch()
    with torch.no_grad():
        own, _ = response_logprobs(model, mb, share_prompts=False, head_chunk_tokens=None)
        plain = token_logprobs(model.get_output_embeddings()(torch.randn(3, 16)), torch.zeros(3, dtype=torch.long))
    assert plain.shape == (3,)
    algo = AlgorithmSettings()
    mb.old_logprobs = torch.zeros_like(mb.sampler_logprobs)

    def loss_and_grads(head):
        model.zero_grad()
        loss, m = micro_batch_loss(model, mb, algo, share_prompts=True, head_chunk_tokens=head)
        loss.backward()
        return loss.detach(), m["logprob_mean"], {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, logp0, grads0 = loss_and_grads(None)
    assert logp0 == pytest.approx(float(own.mean()), rel=1e-5)
    for head in (0, 2):
        loss, logp, grads = loss_and_grads(head)
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-7)
        assert logp == pytest.approx(logp0, rel=1e-5)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_scaled_head_is_refused_with_what_to_set():
    """Cohere multiplies its logits by ``logit_scale``: the head alone would give other log-probs, so the
    loss-position head refuses the model and names the setting that takes the model's own logits."""
    model = tiny_model("Cohere", logit_scale=0.5)
    with pytest.raises(HeadError, match=r"logit_scale=0.5.*head_at_loss_positions=false"):
        lm_head(model)
    # the model's own logits still work
    response_logprobs(model, micro_batch(), head_chunk_tokens=None)


def test_check_head_catches_a_transform_no_list_knows():
    """A model whose forward changes its logits in a way ``lm_head`` does not know (here doubled) is caught
    at its first forward; a model that does not is checked once, then trusted."""
    model = tiny_model("Llama")
    mb = micro_batch()
    response_logprobs(model, mb)
    assert model._pettingflow_head_checked

    other = tiny_model("Llama")
    head = other.lm_head
    other.lm_head = torch.nn.Sequential(head)  # the forward's head: the plain one, then doubled
    other.lm_head.append(torch.nn.Identity())
    other.lm_head.register_forward_hook(lambda _m, _i, out: out * 2)
    other.get_output_embeddings = lambda: head  # what lm_head() will use: the plain one
    with pytest.raises(HeadError, match="differ from its LM head"):
        response_logprobs(other, mb)
    with pytest.raises(HeadError, match="largest difference"):
        check_head(other, torch.randn(1, 1, 16), 2 * head(torch.randn(1, 1, 16)))
