"""The optimizer of an update: AdamW that can leave whole param groups (other agents' adapters) untouched.

Its hyperparameters are read from ``TrainingSettings`` here and nowhere else: ``OptimizerConfig.from_training``
once per update, ``build_optimizer`` when the engine is built, ``apply_config`` when the optimizer already exists
(a resident learner's next update, or groups a checkpoint restored with the values they were saved with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pettingflow.configs.settings import TrainingSettings


@dataclass(frozen=True)
class OptimizerConfig:
    """The AdamW hyperparameters of one update (constant over it: there is no scheduler)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def from_training(cls, training: TrainingSettings) -> OptimizerConfig:
        """The one place the update reads ``training.lr`` and ``training.weight_decay``."""
        return cls(lr=training.lr, weight_decay=training.weight_decay)


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


def build_optimizer(groups: list[dict[str, Any]], config: OptimizerConfig) -> GroupMaskedAdamW:
    """The client optimizer DeepSpeed wraps. fused=True: torch's single-kernel CPU/CUDA AdamW, ~7x faster than
    foreach on CPU here, no JIT build."""
    return GroupMaskedAdamW(
        groups, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas, eps=config.eps, fused=True
    )


def apply_config(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
    """Set ``config``'s values on every param group of an optimizer that already exists: a restored checkpoint's
    groups hold the values they were saved with, and a resident learner's groups those of its previous update."""
    for group in optimizer.param_groups:
        group["lr"] = config.lr
        group["weight_decay"] = config.weight_decay
        group["betas"] = config.betas
        group["eps"] = config.eps
