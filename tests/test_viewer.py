"""The trajectory viewer on a stored run written here: episode list and filters, one episode turn by turn
(tokens shaded by mask and advantage, tree candidates, sandbox output, dropped rows), two attempts side by
side, errors, and the page in headless Chromium. A real run's pages are checked in ``test_flows.py``."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
from browser import chromium_or_skip, dom, screenshot, serving
from factories import trajectory_row
from fastapi.testclient import TestClient

from pettingflow.analysis.viewer import EpisodeFilter, load_episodes, shade
from pettingflow.analysis.viewer_app import create_app, is_loopback, serve
from pettingflow.configs.loader import load_config
from pettingflow.runs.run import start_or_resume
from pettingflow.storage import RunLayout, trajectories_to_table, write_trajectories


def fake_decode(policy: str, ids) -> list[str]:
    return [f"<{i}>" for i in ids]


def _info(turn: dict, team: float) -> str:
    return json.dumps({"team_reward": team, "turn": turn})


SANDBOX = [
    {"case": "assert f(1) == 2", "passed": True, "error": None},
    {"case": "assert f(2) == 3", "passed": False, "error": "AssertionError: left side was 4"},
]


def stored_rows() -> list[dict]:
    """Episode 0: coder (3 tree candidates at turn 0, the second continued) then tester, solved. Episode 1: another
    env, coder only, ended at max turns."""
    rows = []
    for branch, reward in enumerate([0.0, 1.0, 0.5]):
        rows.append(
            trajectory_row(
                rollout_idx=0,
                uid="u-code",
                turn_idx=0,
                branch_idx=branch,
                continued=branch == 1,
                reward=reward,
                success=reward == 1.0,
                prompt_text="write f please",
                response_text=f"code {branch}",
                response_ids=[20 + branch, 30, 31, 32],
                response_mask=[1, 1, 0, 1],
                info_json=_info({"role": "code", "sandbox": SANDBOX}, 1.0),
            )
        )
    rows.append(
        trajectory_row(
            rollout_idx=0,
            uid="u-test",
            turn_idx=1,
            agent_idx=1,
            agent_name="test_generator",
            reward=0.25,
            success=False,
            prompt_text="tests for f?",
            prefill="assert f(",
            response_text="1) == 2",
            info_json=_info({"role": "test"}, 1.0),
        )
    )
    rows.append(
        trajectory_row(
            rollout_idx=1,
            sample_idx=1,
            env_name="other-env",
            uid="u-other",
            reward=0.0,
            success=False,
            done=True,
            truncated=True,
            outcome="max_turns",
            prompt_text="second episode",
            response_text="nope",
            info_json=_info({}, 0.0),
        )
    )
    return rows


def commit_batch(layout: RunLayout, name: str, rows: list[dict], attempt: int, advantages=None) -> None:
    step = layout.step(0, name, attempt).begin()
    table = trajectories_to_table(rows)
    if advantages is not None:
        table = table.append_column("advantage", pa.array(advantages, pa.float32()))
    step.write_table("batch-shared.parquet", table)
    step.commit()


@pytest.fixture
def layout(tmp_path) -> RunLayout:
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ref, _ = start_or_resume(config, "code-env", [f"run.storage_root={tmp_path}"], "run-view", {})
    layout = ref.layout()
    rows = stored_rows()
    write_trajectories(layout.step(0, "rollouts").begin(), rows)
    # attempt 0: the filter kept every row but episode 1's; attempt 1 (a re-run): it dropped the tester's row too
    kept0 = rows[:4]
    commit_batch(layout, "filtered", kept0, 0)
    commit_batch(layout, "advantages", kept0, 0, [-1.0, 1.0, 0.0, 0.5])
    layout.write_attempt_info(0, 1, {"overrides": ["training.lr=1e-6"], "from_step": "filtered"})
    kept1 = rows[:3]
    commit_batch(layout, "filtered", kept1, 1)
    commit_batch(layout, "advantages", kept1, 1, [-0.5, 0.5, 0.0])
    for attempt, lr in ((0, 1e-5), (1, 1e-6)):
        report = layout.step(0, "report", attempt).begin()
        report.write_json("metrics.json", {"update/shared/lr": lr, "filter/rows_kept": 4 - attempt})
        report.commit()
    return layout


@pytest.fixture
def client(layout) -> TestClient:
    return TestClient(create_app(layout, decode=fake_decode))


def test_episode_list_and_its_filters(client) -> None:
    page = client.get("/iteration/0").text
    assert "2 of 2 episodes" in page and page.count('class="episode-row"') == 2
    assert "team_reward=1.0" in page and "<td>ended at max turns</td>" in page and "<td>solved</td>" in page
    only_tester = client.get("/iteration/0", params={"agent": "test_generator"}).text
    assert "1 of 2 episodes" in only_tester and 'href="/episode/0/0' in only_tester
    assert client.get("/iteration/0", params={"env": "other-env"}).text.count('class="episode-row"') == 1
    assert "1 of 2 episodes" in client.get("/iteration/0", params={"min_reward": "0.5"}).text
    assert "1 of 2 episodes" in client.get("/iteration/0", params={"outcome": "solved"}).text
    assert "1 of 2 episodes" in client.get("/iteration/0", params={"outcome": "ended at max turns"}).text
    # every label is offered, also one no episode has
    assert "0 of 2 episodes" in client.get("/iteration/0", params={"outcome": "failed"}).text
    assert "<option>failed</option>" in page and "<option>not finished</option>" in page
    assert client.get("/", follow_redirects=False).headers["location"] == "/iteration/0"


def test_one_episode_turn_by_turn_with_tokens_shaded_by_mask_and_advantage(client) -> None:
    page = client.get("/episode/0/0").text
    assert page.index("turn 0 · code_generator") < page.index("turn 1 · test_generator")
    # three candidates of turn 0 side by side, the one the episode continued from marked
    assert page.count("candidate ") >= 3 and "candidate 1 (continued)" in page
    assert len(re.findall(r'class="turn candidate continued', page)) == 1
    # each token is a span: env tokens (mask 0) unshaded, model tokens green / red by the row's advantage
    assert page.count('class="tok env"') == 4  # one per row (mask 1,1,0,1)
    assert "&lt;21&gt;" in page and "&lt;30&gt;" in page  # token texts from the decoder, escaped
    assert "rgba(46,160,67,0.62)" in page  # advantage +1.0, the batch's largest: full shade
    assert "rgba(215,58,73,0.62)" in page  # advantage -1.0
    assert "advantage +0.500" in page and "advantage -1.000" in page
    # what the agent saw, and what the sandbox said
    assert "write f please" in page and "tests for f?" in page
    # the tester's prefill, marked apart from the model's tokens (it is prompt, never trained)
    assert page.count('class="tok prefill"') == 1 and ">assert f(</span>" in page
    assert "sandbox output" in page and "AssertionError: left side was 4" in page
    # a re-run attempt's advantages; a row its filter dropped says so
    again = client.get("/episode/0/0", params={"attempt": 1}).text
    assert "advantage +0.500" in again and "dropped by the filter" in again


def test_two_attempts_side_by_side(client) -> None:
    page = client.get("/compare/0", params={"a": 0, "b": 1}).text
    assert "training.lr=1e-6" in page and "filtered" in page
    assert re.search(r'<tr class="diff"><td>update/shared/lr</td><td class="num">1e-05</td>', page) or (
        "update/shared/lr" in page and page.count('class="diff"') >= 3
    )
    assert "dropped" in page  # the tester's row in attempt 1
    iteration = client.get("/iteration/0").text
    assert 'id="compare-link"' in iteration


def test_errors_say_what_is_missing(client, layout) -> None:
    assert "no episode 9" in client.get("/episode/0/9").json()["detail"]
    assert "not [5]" in client.get("/compare/0", params={"a": 0, "b": 5}).json()["detail"]
    assert client.get("/iteration/3").status_code == 404
    with pytest.raises(ValueError, match="loopback only"):
        serve(layout, host="0.0.0.0")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("example.com")


def test_shading_and_filters_are_plain_functions(layout) -> None:
    assert shade(0.5, 1.0) == 0.5 and shade(-3.0, 1.0) == -1.0 and shade(None, 1.0) == 0.0 and shade(1.0, 0.0) == 0
    episodes = load_episodes(layout, 0, decode=fake_decode, episode=0)
    [episode] = episodes
    assert episode.final_rewards() == {"code_generator": 1.0, "test_generator": 0.25}  # the continued candidate's
    tokens = episode.turns[1].tokens
    assert [t.model for t in tokens] == [True, True, False, True] and tokens[2].shade == 0.0
    assert EpisodeFilter(agent="test_generator", max_reward=0.2).keeps(episode) is False
    assert EpisodeFilter(agent="test_generator", min_reward=0.2).keeps(episode) is True
    # without a tokenizer the responses are shown whole
    assert load_episodes(layout, 0, episode=0)[0].turns[0].tokens is None


def test_the_pages_in_headless_chromium(layout, tmp_path) -> None:
    browser = chromium_or_skip()
    with serving(create_app(layout, decode=fake_decode)) as url:
        listing = dom(browser, f"{url}/iteration/0", tmp_path / "profile")
        assert listing.count('class="episode-row"') == 2 and "<form" in listing
        page = dom(browser, f"{url}/episode/0/0", tmp_path / "profile")
        assert page.count('class="tok env"') == 4 and 'class="branches"' in page
        shot = screenshot(browser, f"{url}/episode/0/0", tmp_path / "episode.png", tmp_path / "profile")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_the_command_and_the_report_link(layout, tmp_path) -> None:
    from typer.testing import CliRunner

    from pettingflow.analysis.viewer import viewer_markdown
    from pettingflow.cli import app

    runner = CliRunner()
    root = ["--root", str(tmp_path)]
    refused = runner.invoke(app, ["trajectories", "view", "run-view", "--host", "0.0.0.0", *root])
    assert refused.exit_code == 2 and "loopback only" in refused.output
    missing = runner.invoke(app, ["trajectories", "view", "no-such-run", *root])
    assert missing.exit_code == 2 and "has no iterations" in missing.output
    text = viewer_markdown("run-view", 3, attempt=1)
    assert (
        "pettingflow trajectories view run-view -k 3" in text and "http://127.0.0.1:8765/iteration/3?attempt=1" in text
    )
