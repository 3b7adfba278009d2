"""Multi-level rewards: a team term mixed into each agent's local reward, and returns over an agent's turns.

Source: AT-GRPO (Zhao et al. 2025, "Stronger Together", arXiv 2510.11062), whose per-turn reward of agent
``i`` is ``r = r_local + alpha * r_team``. Returns over the same agent's later turns (``gamma``) are our
addition (docs/rl.md):

- ``mix_rewards``:        ``m = local + alpha * team`` per row.
- ``discounted_returns``: ``G = m + gamma * G_next``, where ``G_next`` is the return of the same agent's next
                          turn on the episode's *path* (its next ``continued`` row; 0 after its last turn).
                          A tree candidate that was not continued has no future of its own: it gets the
                          path's, the same as its siblings, so the future term is shared within a group.

``gamma = 0`` gives the mixed per-turn rewards; ``alpha = 0, gamma = 0`` gives the local rewards unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def _finite(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64)
    if out.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {out.shape}")
    if not np.isfinite(out).all():
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise ValueError(f"{name} must be finite; {name}[{bad}] = {out[bad]}")
    return out


def mix_rewards(local: Sequence[float] | np.ndarray, team: Sequence[float] | np.ndarray, alpha: float) -> np.ndarray:
    """``local + alpha * team`` per row (float64). ``alpha`` >= 0 (``algorithm.team_reward_weight``)."""
    if not (np.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha (team_reward_weight) must be a finite number >= 0, got {alpha!r}")
    r, t = _finite(local, "local"), _finite(team, "team")
    if len(r) != len(t):
        raise ValueError(f"local has {len(r)} entries but team has {len(t)}")
    return r + alpha * t


def discounted_returns(
    rewards: Sequence[float] | np.ndarray,
    episode: Sequence[Hashable],
    agent: Sequence[Hashable],
    turn: Sequence[int],
    continued: Sequence[bool],
    gamma: float,
) -> np.ndarray:
    """Per row: its reward plus ``gamma`` times the return of the same agent's next turn on the episode's path.

    Rows are grouped by ``(episode, agent)``; within a group the ``continued`` rows are the path, at most one
    per turn. ``G(path row at turn t) = r_t + gamma * G(next path row)``; a row that was not continued gets
    ``r + gamma * G(first path row after its turn)``. Rows may come in any order; the result is in input order.
    """
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    r = _finite(rewards, "rewards")
    n = len(r)
    if not (len(episode) == len(agent) == len(turn) == len(continued) == n):
        raise ValueError(
            f"rewards, episode, agent, turn and continued must have the same length, got "
            f"{n}, {len(episode)}, {len(agent)}, {len(turn)}, {len(continued)}"
        )
    if gamma == 0.0:
        return r.copy()
    groups: dict[tuple[Hashable, Hashable], list[int]] = {}
    for i in range(n):
        groups.setdefault((episode[i], agent[i]), []).append(i)
    out = np.empty(n, dtype=np.float64)
    for (ep, ag), rows in groups.items():
        path: dict[int, int] = {}
        for i in rows:
            if continued[i]:
                if int(turn[i]) in path:
                    raise ValueError(
                        f"episode {ep!r}, agent {ag!r}: two continued rows at turn {int(turn[i])} "
                        f"(rows {path[int(turn[i])]} and {i}); an episode's path has one row per turn"
                    )
                path[int(turn[i])] = i
        # returns along the path, latest turn first: future[t] = return of the first path row after turn t
        path_turns = sorted(path)
        path_return: dict[int, float] = {}
        nxt = 0.0
        for t in reversed(path_turns):
            nxt = r[path[t]] + gamma * nxt
            path_return[t] = nxt
        for i in rows:
            later = [t for t in path_turns if t > int(turn[i])]
            out[i] = r[i] + (gamma * path_return[later[0]] if later else 0.0)
    return out
