"""PettingFlow: multi-agent, multi-turn RL for LLM agents, one Prefect flow run per iteration.

The concerns live in the subpackages (`pettingflow.storage`, `pettingflow.rl`, ...), which map to
the top-level folders of the repository; see docs/architecture.md.
"""

__version__ = "0.1.0"
