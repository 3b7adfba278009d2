"""Policy updates: one recipe (``worker.UpdateWorker``) run by the ranks of a learner (``learner.Learner``).

``run_update(UpdateSpec(...))`` runs one update in a learner of its own and returns its metrics; a run keeps one
learner per policy for all its updates. See docs/training.md. Importing this package imports neither torch nor
Ray (the ranks do).
"""

from pettingflow.training.launch import UpdateError, UpdateSpec, spec_from_config
from pettingflow.training.learner import run_update

__all__ = ["UpdateError", "UpdateSpec", "run_update", "spec_from_config"]
