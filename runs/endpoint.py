"""Where a policy is served: what the runtime hands the rollout and sync steps.

A module of its own so that the steps (which only read it) and the runtime (which builds it) both import
it without the steps importing the runtime's server machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyEndpoint:
    """Where and under which names a policy is served right now."""

    policy: str
    url: str  # the first replica's
    served_model: str
    model_dir: str
    adapters: dict[str, str] = field(default_factory=dict)  # agent name -> served LoRA name (L2)
    replica_urls: tuple[str, ...] = ()  # every replica's, when there are several (``urls``)
    api_key: str | None = field(default=None, repr=False)  # the servers' (inference/auth.py); never logged

    @property
    def urls(self) -> tuple[str, ...]:
        """Every replica serving the policy (the same weights on each)."""
        return self.replica_urls or (self.url,)
