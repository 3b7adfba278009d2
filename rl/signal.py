"""Is there anything to learn from this batch? The GRPO signal of an iteration, and why it may be zero.

GRPO's advantage is a sample's reward relative to the other samples of its UID group, so a group whose G
rewards are all equal contributes exactly 0 to the update. When every group is like that, the update
runs, reports ``grad_norm`` 0 and changes nothing, which looks like a normal, successful iteration. The
usual causes are a task set the model never solves (every reward 0: SmolLM2-135M on HumanEval), one it
always solves (every reward 1), or a filter that dropped every group. ``signal_report`` tells which, so
the run can say so where a user looks (log, report artifact, run summary, ``runs show``).

Pure functions: rewards and UIDs in, numbers and a sentence out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pettingflow.rl.uids import group_indices


@dataclass(frozen=True)
class GroupSpread:
    """How a batch's UID groups split by reward: the groups GRPO learns from are ``varied``."""

    groups: int
    varied: int  # at least two different rewards: non-zero advantages
    all_zero: int  # every reward 0
    all_max: int  # every reward equal to the batch's highest reward, which is above 0
    other_equal: int  # every reward equal, at some other value


def group_spread(uids: Sequence[str], rewards: Sequence[float] | np.ndarray) -> GroupSpread:
    """Count the groups of ``uids`` (rows in any order) by how their ``rewards`` differ."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(uids) != r.size:
        raise ValueError(f"group_spread needs one reward per uid, got {len(uids)} uids and {r.size} rewards")
    top = float(r.max()) if r.size else 0.0
    varied = all_zero = all_max = other = 0
    groups = group_indices(list(uids))
    for idx in groups.values():
        values = r[idx]
        if values.max() != values.min():
            varied += 1
        elif values[0] == 0.0:
            all_zero += 1
        elif values[0] == top and top > 0:  # all at a penalty (e.g. -0.5 for no answer) is not "too easy"
            all_max += 1
        else:
            other += 1
    return GroupSpread(len(groups), varied, all_zero, all_max, other)


def zero_signal_message(
    policy: str,
    spread: GroupSpread,
    rows_before_filter: int,
    rows_after_filter: int,
    filter_method: str,
    group_setting: str = "env.group_size",
) -> str:
    """The warning for a policy whose training batch has no non-zero advantage, with its likely causes.
    ``group_setting``: the setting that sizes a group (``rollout.tree.branches`` in tree mode, where
    ``env.group_size`` must stay 1)."""
    head = f"no learning signal for policy {policy!r}: no row of its batch has a non-zero advantage, so its update "
    head += "changes nothing (grad_norm 0)."
    if rows_before_filter == 0:
        return f"{head} Its agents produced no rows this iteration (check the rollouts and the agents' policy names)."
    causes = []
    if spread.groups and spread.all_zero == spread.groups:
        causes.append(
            f"every reward of its {spread.groups} groups was 0: the tasks are too hard for the model (e.g. "
            "SmolLM2-135M on HumanEval); train on a task set it partly solves (env.dataset.source=basic-python), "
            f"or raise the sampling temperature or {group_setting}"
        )
    elif spread.groups and spread.all_max == spread.groups:
        causes.append(
            f"every group of its {spread.groups} got the same, highest reward: the tasks are too easy for the model; "
            "use harder tasks"
        )
    elif spread.varied == 0:
        causes.append(
            f"within each of its {spread.groups} groups every sample got the same reward ({spread.all_zero} groups "
            f"all 0, {spread.all_max} all at the top reward, {spread.other_equal} at another value): raise the "
            f"sampling temperature or {group_setting}"
        )
    if rows_after_filter == 0:
        causes.append(
            f"the filter ({filter_method}) kept none of its {rows_before_filter} rows"
            + (" (dapo drops every group whose rewards are all equal)" if filter_method == "dapo" else "")
        )
    if not causes:
        causes.append(f"{spread.varied} of {spread.groups} groups had differing rewards, but none reached the batch")
    return f"{head} Likely cause: " + "; ".join(causes) + "."
