"""The optimizer of an update: AdamW that can leave whole param groups (other agents' adapters) untouched."""

from __future__ import annotations

from typing import Any

import torch


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
