"""How close each phase of an iteration runs to what the machine can do: pure arithmetic, no I/O.

The peaks come from ``pettingflow hardware probe`` (``pettingflow/hardware_probe.py``): matrix-multiply FLOP/s
at the model's own shapes and memory bandwidth, measured once per machine. Against them:

- **the update**: achieved FLOP/s = the training pass's matmul FLOPs / its seconds. A dense decoder's matmuls
  cost 2·N FLOPs per token forward (N = the weights that multiply: every projection and the LM head, not the
  embedding lookup), 4·N backward, and one more forward with gradient checkpointing: 6·N or 8·N per token, the
  LM head counted only at the positions the loss reads (the model tokens).
  Attention scores (about 4·layers·hidden·context/2 per token) are not counted; at SmolLM2's 30 layers, 576
  hidden and a few hundred tokens of context they add about 5 %, so the fraction reported is a slight
  underestimate.
- **generation**: one decode step reads every weight once for all sequences in flight, so ``concurrency`` streams
  cannot beat concurrency · bandwidth / weight bytes tokens/s. The KV cache's reads are not counted, so the true
  bound is lower and the fraction reported an underestimate too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes, from its Hugging Face ``config.json``."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        missing = [
            k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size") if k not in config
        ]
        if missing:
            raise ValueError(f"model config.json lacks {missing}: not a Llama-style decoder this estimate covers")
        heads = int(config.get("num_attention_heads", 1))
        return cls(
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab=int(config["vocab_size"]),
        )

    def multiplies(self) -> dict[str, tuple[int, int, int]]:
        """Each kind of weight matrix a forward multiplies by: label -> (rows k, columns n, how many there are)."""
        kv = self.kv_heads * (self.hidden // self.heads)
        return {
            "attention q/o": (self.hidden, self.hidden, 2 * self.layers),
            "attention k/v": (self.hidden, kv, 2 * self.layers),
            "mlp up/gate": (self.hidden, self.intermediate, 2 * self.layers),
            "mlp down": (self.intermediate, self.hidden, self.layers),
            "lm head": (self.hidden, self.vocab, 1),
        }

    def matmul_shapes(self, tokens: int) -> dict[str, tuple[int, int, int]]:
        """(m, k, n) of the multiplies one forward of ``tokens`` tokens makes: what the probe measures."""
        return {label: (tokens, k, n) for label, (k, n, _) in self.multiplies().items()}

    def shape_weights(self) -> dict[str, int]:
        """The weights of each kind: its share of one token's forward FLOPs (2 per weight)."""
        return {label: k * n * count for label, (k, n, count) in self.multiplies().items()}

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matrix multiply per token: attention and gated-MLP projections, LM head."""
        return sum(self.shape_weights().values())

    @property
    def weights(self) -> int:
        """Every weight a decode step reads (the tied embedding counted once, as the LM head)."""
        return self.matmul_params + self.layers * 2 * self.hidden + self.hidden  # + the norms


def train_flops(
    shape: ModelShape, tokens: float, head_tokens: float | None = None, checkpointing: bool = False
) -> float:
    """Matmul FLOPs a training pass needs: 6·N per token (8·N with checkpointing), the LM head's share only for
    the ``head_tokens`` whose log-probs the loss uses (default: every token). Useful work, as MFU counts it: a
    pass that computes the head at prompt positions too does more, and is not credited for it."""
    per_weight = 8.0 if checkpointing else 6.0
    head = shape.vocab * shape.hidden
    head_tokens = tokens if head_tokens is None else head_tokens
    return per_weight * ((shape.matmul_params - head) * tokens + head * head_tokens)


def model_shape_peak(shape: ModelShape, flops_by_shape: Mapping[str, float]) -> float:
    """The FLOP/s a pass would reach if every multiply ran at the probe's rate for its shape: the rates
    averaged by time (each shape's share of the FLOPs divided by its rate), so a slow LM head weighs in."""
    weights = shape.shape_weights()
    missing = [k for k in weights if k not in flops_by_shape or flops_by_shape[k] <= 0]
    if missing:
        raise ValueError(f"the probe has no rate for {missing}: run `pettingflow hardware probe --force`")
    total = sum(weights.values())
    return total / sum(w / flops_by_shape[k] for k, w in weights.items())


def decode_bound(shape: ModelShape, dtype: str, bandwidth: float, concurrency: int) -> float:
    """Tokens/s that ``concurrency`` decode streams cannot exceed: each step reads every weight once."""
    weight_bytes = shape.weights * DTYPE_BYTES[dtype]
    return max(concurrency, 1) * bandwidth / weight_bytes


def update_fraction(
    shape: ModelShape,
    tokens_per_s: float,
    peak: float,
    head_tokens_per_s: float | None = None,
    checkpointing: bool = False,
) -> tuple[float, float]:
    """(matmul FLOP/s a training pass achieved at these token rates, its fraction of ``peak``)."""
    achieved = train_flops(shape, tokens_per_s, head_tokens_per_s, checkpointing)
    return achieved, (achieved / peak if peak > 0 else 0.0)
