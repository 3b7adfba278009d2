"""Policy update jobs: one DeepSpeed process (or N under torchrun) per policy and iteration.

``run_update(UpdateSpec(...))`` launches ``python -m pettingflow.training.worker`` and returns its metrics;
see docs/training.md. Importing this package does not import torch (the worker does).
"""

from pettingflow.training.launch import UpdateError, UpdateSpec, run_update, spec_from_config

__all__ = ["UpdateError", "UpdateSpec", "run_update", "spec_from_config"]
