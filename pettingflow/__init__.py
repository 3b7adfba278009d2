"""PettingFlow: multi-agent, multi-turn RL for LLM agents, one Prefect flow run per iteration.

The concerns live in the subpackages (`pettingflow.storage`, `pettingflow.rl`, ...), which map to
the top-level folders of the repository; see docs/architecture.md.
"""

import os

__version__ = "0.1.0"

# Offline by default: a Prefect server started from a PettingFlow process (the temporary one of a flow called
# without PREFECT_API_URL, e.g. `pettingflow rerun`) inherits this and sends no telemetry, which on a machine
# without internet otherwise logs an ERROR with a traceback every few minutes; Ray likewise. Set either
# variable yourself to choose otherwise.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
