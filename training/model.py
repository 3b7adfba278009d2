"""Policy and reference models of an update job, log-prob and loss computation for one micro-batch.

Two shapes of trainable weights (PettingLLMs' trainer):

- full (``specialization: prompt`` L0/L1 and ``full`` L3): every weight of ``AutoModelForCausalLM`` loaded
  from an HF folder trains. The KL reference is a separate frozen copy of the *initial* weights
  (``base_model_dir``), loaded only when ``kl_coef > 0``.
- LoRA (``specialization: lora``, L2): one frozen base model plus one named peft adapter per agent, created
  fresh (B = 0, so the policy starts equal to the base) or loaded from the previous iteration's adapter
  folders. The KL reference is the same base with adapters disabled (peft's ``disable_adapter`` context):
  no second copy of the weights.

The loss itself comes from ``pettingflow.rl.losses.total_loss``; this module only produces its inputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pettingflow.configs.settings import AlgorithmSettings, LoraSettings
from pettingflow.rl.losses import entropy_from_logits, total_loss
from pettingflow.training.data import MicroBatch

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def resolve_dtype(name: str) -> str:
    """``training.dtype`` -> ``bf16`` | ``fp32`` on this machine. ``auto`` is bf16 where it is computed natively
    (CUDA, or a CPU whose oneDNN has bf16 kernels: AVX-512 / AMX) and fp32 elsewhere: on an AVX2-only CPU torch
    falls back to slow bf16 kernels (a SmolLM2 backward pass was 20x slower than in fp32 here)."""
    from pettingflow.hardware import cpu_has_fast_bf16

    if name != "auto":
        return name
    return "bf16" if torch.cuda.is_available() or cpu_has_fast_bf16() else "fp32"


def torch_dtype(name: str) -> torch.dtype:
    """``training.dtype`` (``auto`` | ``bf16`` | ``fp32``) -> torch dtype."""
    try:
        return DTYPES[resolve_dtype(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(DTYPES)}") from None


def load_causal_lm(path: str | Path, dtype: torch.dtype) -> Any:
    """``AutoModelForCausalLM`` from a local HF folder (never a hub), KV cache off (training only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.config.use_cache = False
    return model


def load_reference(path: str | Path, dtype: torch.dtype) -> Any:
    """A frozen, eval-mode copy of the weights at ``path`` (full-weight KL reference)."""
    model = load_causal_lm(path, dtype).eval()
    model.requires_grad_(False)
    return model


# ------------------------------------------------------------------------------------------------ LoRA
def lora_config(settings: LoraSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def check_adapter_name(name: str) -> str:
    """peft adapter names become ModuleDict keys: no dots, not empty."""
    if not name or "." in name or name.startswith("_"):
        raise ValueError(f"agent name {name!r} cannot name a LoRA adapter (no dots, not empty, no leading _)")
    return name


def build_lora_model(
    base: Any, agents: Sequence[str], settings: LoraSettings, adapters_in: Mapping[str, str | None] | None = None
) -> Any:
    """Wrap ``base`` in a ``PeftModel`` holding one adapter per agent (named after the agent).

    An agent whose entry in ``adapters_in`` is a folder gets that adapter (its own ``adapter_config.json``
    wins over ``settings``; a mismatch is logged); others get a fresh adapter from ``settings``. Every
    adapter's weights are trainable, the base is frozen.
    """
    from peft import PeftModel, get_peft_model

    if not agents:
        raise ValueError("LoRA specialization needs at least one agent")
    adapters_in = dict(adapters_in or {})
    unknown = sorted(set(adapters_in) - set(agents))
    if unknown:
        raise ValueError(f"adapters_in names agents {unknown} that are not agents of this policy {list(agents)}")
    config = lora_config(settings)
    model = None
    for name in agents:
        check_adapter_name(name)
        folder = adapters_in.get(name)
        if folder is not None:
            _check_adapter_folder(folder, settings)
            if model is None:
                model = PeftModel.from_pretrained(base, folder, adapter_name=name, is_trainable=True)
            else:
                model.load_adapter(folder, adapter_name=name, is_trainable=True)
        elif model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    model.base_model.set_adapter(list(agents))  # all active (and trainable); activate_adapter picks by scale
    for param in adapter_parameters(model, agents).values():
        param.requires_grad_(True)
    activate_adapter(model, agents[0])
    return model


def _check_adapter_folder(folder: str, settings: LoraSettings) -> None:
    cfg_path = Path(folder) / "adapter_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} is not a peft adapter folder (no adapter_config.json)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("r") != settings.rank or cfg.get("lora_alpha") != settings.alpha:
        log.warning(
            "adapter %s has r=%s alpha=%s but the config asks for rank=%s alpha=%s; the folder's values are used",
            folder,
            cfg.get("r"),
            cfg.get("lora_alpha"),
            settings.rank,
            settings.alpha,
        )


def adapter_parameters(model: Any, agents: Sequence[str]) -> dict[str, torch.nn.Parameter]:
    """Trainable LoRA parameters of every agent's adapter, by parameter name."""
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        if "lora_" in name and any(f".{agent}." in name for agent in agents):
            out[name] = param
    return out


def adapter_parameter_groups(model: Any, agents: Sequence[str]) -> list[dict[str, Any]]:
    """One optimizer param group per agent adapter (``{"params": [...], "adapter": name}``).

    Separate groups let the update step skip every adapter but the one whose agent's rows make the current
    optimizer step (``GroupMaskedAdamW``).
    """
    groups = []
    for agent in agents:
        params = [p for n, p in model.named_parameters() if "lora_" in n and f".{agent}." in n]
        if not params:
            raise ValueError(f"adapter {agent!r} has no parameters; check lora.target_modules")
        groups.append({"params": params, "adapter": agent})
    return groups


def activate_adapter(model: Any, name: str) -> None:
    """Route the forward pass through adapter ``name`` only, keeping every adapter in the graph.

    All adapters stay *active* in peft's sense (set once by ``build_lora_model``); the others get scale 0
    (``LoraLayer.set_scale``), so their contribution is exactly ``+0`` and their gradient exactly 0 - but
    they still take part in every forward and backward. That matters for DeepSpeed: with peft's
    ``set_adapter`` the inactive adapters would be unused parameters, and ZeRO-3 then keeps their stale
    gradients from an earlier step (seen here: they leaked into the next step's gradient norm and Adam
    moments); it also keeps gradient hooks identical on every rank.
    """
    from peft.tuners.lora import LoraLayer

    agents = list(model.peft_config)
    if name not in agents:
        raise KeyError(f"no adapter {name!r}; adapters: {agents}")
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in agents:
                module.set_scale(adapter, 1.0 if adapter == name else 0.0)


def load_adapter_weights(model: Any, folders: Mapping[str, str | None]) -> None:
    """Set each named adapter of ``model`` to the weights in its peft folder (agents without one: unchanged)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    for agent, folder in folders.items():
        if folder is not None:
            set_peft_model_state_dict(model, load_file(str(Path(folder) / "adapter_model.safetensors")), agent)


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The LoRA reference: the base with every adapter disabled (peft's ``disable_adapter``)."""
    with model.disable_adapter():
        yield


class GroupMaskedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that leaves param groups with ``group["active"] == False`` entirely alone.

    L2 trains one adapter per agent, one param group per adapter. Under DeepSpeed the inactive adapters get
    zero (not absent) gradients, and a plain AdamW step would still move them (momentum, weight decay) and
    advance their moments and step counts. Skipping their groups keeps an adapter's weights *and* optimizer
    state a function of its own agent's rows only. Works under ZeRO 1-3 because DeepSpeed keeps the client
    optimizer's group dicts (it only swaps their ``params`` for flat fp32 partitions).
    """

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        groups = self.param_groups
        active = [g for g in groups if g.get("active", True)]
        if len(active) == len(groups):
            return super().step(closure)
        self.param_groups = active
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


# ------------------------------------------------------------------------------------------------ math
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO loss of one micro-batch (``total_loss``) with the current policy's log-probs.

    Needs ``mb.old_logprobs`` (and ``mb.ref_logprobs`` when ``kl_coef > 0``), unless ``old_is_current``: no optimizer
    step has happened yet in this update, so the old log-probs (those of the weights the update started
    from) equal the current ones and are taken from this forward, detached, instead of a separate one
    (ratio 1; TRL does the same with one iteration per generation batch).
    Entropy is always reported (over the model tokens only); it carries gradient only when
    ``entropy_coef > 0``. Metrics also get ``logprob_mean`` (mean current log-prob of the model tokens),
    ``model_tokens`` and, with ``old_is_current``, ``sampler_abs_diff_sum`` (sum of |current - sampler|).
    ``share_prompts``: see ``response_logits``.
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
        with torch.no_grad():
            entropy = scatter_valid(entropy_from_logits(logits.detach()), mb.loss_mask)
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
    )
    n = int(valid.sum())
    metrics["logprob_mean"] = float(logp.detach().sum() / max(n, 1))
    metrics["model_tokens"] = float(n)
    if old_is_current:
        metrics["sampler_abs_diff_sum"] = float((old - mb.sampler_logprobs).abs()[valid].sum())
    return loss, metrics


# ------------------------------------------------------------------------------------------------ saving
def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer/chat-template files that exist in ``src`` and not yet in ``dst``; return their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def save_full_model(model: Any, state_dict: Mapping[str, torch.Tensor], out: str | Path, init_dir: str | Path) -> None:
    """HF safetensors folder (``config.json``, ``model.safetensors``, tokenizer files from ``init_dir``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    model.config.use_cache = True  # for inference consumers (vLLM, generate)
    try:
        model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    finally:
        model.config.use_cache = False
    copy_tokenizer_files(init_dir, out)


def save_adapter(model: Any, state_dict: Mapping[str, torch.Tensor], adapter: str, out: str | Path) -> None:
    """One peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained`` and vLLM's LoRA loader read."""
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = get_peft_model_state_dict(model, state_dict=dict(state_dict), adapter_name=adapter)
    if not tensors:
        raise RuntimeError(f"adapter {adapter!r} has no weights in the state dict")
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    config = copy.deepcopy(model.peft_config[adapter])
    config.inference_mode = True
    config.save_pretrained(str(out))
