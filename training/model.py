"""Policy and reference models of an update job: loading, LoRA adapters and saving.

Two shapes of trainable weights (PettingLLMs' trainer):

- full (``specialization: prompt`` L0/L1 and ``full`` L3): every weight of ``AutoModelForCausalLM`` loaded
  from an HF folder trains. The KL reference is a separate frozen copy of the *initial* weights
  (``base_model_dir``), loaded only when ``kl_coef > 0``.
- LoRA (``specialization: lora``, L2): one frozen base model plus one named peft adapter per agent, created
  fresh (B = 0, so the policy starts equal to the base) or loaded from the previous iteration's adapter
  folders. The KL reference is the same base with adapters disabled (peft's ``disable_adapter`` context):
  no second copy of the weights.

Log-probs and the loss of one micro-batch are in ``logprobs.py``; the optimizer in ``optim.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pettingflow.configs.settings import LoraSettings

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
