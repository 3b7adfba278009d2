"""Multi-level rewards (rl/rewards.py): team mixing and returns over an agent's turns, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pettingflow.rl.rewards import discounted_returns, mix_rewards


def test_mix_rewards_adds_alpha_times_team() -> None:
    local, team = [1.0, 0.0, 0.5, -0.5], [1.0, 1.0, 0.0, 0.0]
    assert mix_rewards(local, team, 0.5).tolist() == [1.5, 0.5, 0.5, -0.5]
    assert mix_rewards(local, team, 0.0).tolist() == local  # alpha 0: the local rewards unchanged
    with pytest.raises(ValueError, match="alpha"):
        mix_rewards(local, team, -1.0)
    with pytest.raises(ValueError, match="4 entries but team has 3"):
        mix_rewards(local, team[:3], 1.0)
    with pytest.raises(ValueError, match=r"team\[1\] = nan"):
        mix_rewards(local, [0.0, float("nan"), 0.0, 0.0], 1.0)


# one episode "e" of two agents; agent a acts at turns 0, 2, 4 and agent b at 1, 3 (rows shuffled on purpose).
# Tree rows: a's turn 2 and turn 4 each have a sibling that was not continued.
ROWS = [
    # (episode, agent, turn, continued, reward)
    ("e", "a", 4, True, 3.0),
    ("e", "b", 1, True, 1.0),
    ("e", "a", 0, True, 1.0),
    ("e", "a", 2, False, 0.0),
    ("e", "a", 2, True, 2.0),
    ("e", "b", 3, True, 1.0),
    ("e", "a", 4, False, 5.0),
    ("f", "a", 0, True, 7.0),  # another episode: its own path
]


def _returns(gamma: float) -> list[float]:
    episode, agent, turn, continued, reward = zip(*ROWS, strict=True)
    return discounted_returns(reward, episode, agent, turn, continued, gamma).tolist()


def test_returns_follow_the_same_agents_later_turns_on_the_path() -> None:
    # gamma 0.5, a's path 1, 2, 3: G4 = 3, G2 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    # a's turn-2 sibling: 0 + 0.5*G4 = 1.5; a's turn-4 sibling: 5 (nothing after turn 4)
    # b: G3 = 1, G1 = 1 + 0.5*1 = 1.5; episode f: 7
    assert _returns(0.5) == pytest.approx([3.0, 1.5, 2.75, 1.5, 3.5, 1.0, 5.0, 7.0])
    # gamma 1: plain sums of the agent's path from its turn on
    assert _returns(1.0) == pytest.approx([3.0, 2.0, 6.0, 3.0, 5.0, 1.0, 5.0, 7.0])
    # gamma 0: the rewards themselves (a copy)
    assert _returns(0.0) == [r[-1] for r in ROWS]


def test_returns_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="two continued rows at turn 0"):
        discounted_returns([1.0, 2.0], ["e", "e"], ["a", "a"], [0, 0], [True, True], 0.5)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        discounted_returns([1.0], ["e"], ["a"], [0], [True], 1.5)
    with pytest.raises(ValueError, match="same length"):
        discounted_returns([1.0, 2.0], ["e"], ["a"], [0], [True], 0.5)
    with pytest.raises(ValueError, match="finite"):
        discounted_returns([np.inf], ["e"], ["a"], [0], [True], 0.5)
