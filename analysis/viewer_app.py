"""The trajectory viewer's web app: ``pettingflow trajectories view RUN`` serves it on loopback.

FastAPI routes render Jinja2 templates (``analysis/templates/``, autoescaped) over the data of
``analysis/viewer.py``. It only reads the run's files, so it can run beside a training run. It has no login:
it refuses any address but loopback (reach it from elsewhere through an SSH tunnel).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from pettingflow.analysis.outcomes import LABELS as OUTCOME_LABELS
from pettingflow.analysis.viewer import (
    DEFAULT_PORT,
    VIEW_STEPS,
    EpisodeFilter,
    TokenDecoder,
    compare_attempts,
    load_episodes,
    run_overview,
)
from pettingflow.storage import RunLayout, StepNotCommittedError
from pettingflow.storage.layout import StepName

log = logging.getLogger(__name__)
TEMPLATES = Path(__file__).parent / "templates"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tokenizer_decoder(layout: RunLayout) -> TokenDecoder:
    """Token texts from each policy's own tokenizer (its model folder from the run's config), loaded once.

    Where the model folder is not on this machine (a run read from S3 elsewhere), the viewer shows whole
    responses without token shading instead of failing."""
    stored = layout.read_run_info().get("config", {}).get("policies", [])
    models = {p["name"]: p["model"] for p in stored} if isinstance(stored, list) else {}

    @functools.cache
    def tokenizer(policy: str) -> Any:
        try:
            from transformers import AutoTokenizer

            from pettingflow.inference.models import resolve_model

            return AutoTokenizer.from_pretrained(resolve_model(models[policy]), local_files_only=True)
        except Exception as exc:  # any missing model or tokenizer: shown without tokens, said once in the log
            log.warning("no tokenizer for policy %s (%s): responses are shown as text", policy, exc)
            return None

    def decode(policy: str, ids: Sequence[int]) -> list[str] | None:
        tok = tokenizer(policy)
        return None if tok is None else tok.batch_decode([[i] for i in ids])

    return decode


def create_app(layout: RunLayout, decode: TokenDecoder | None = None) -> Any:
    """The viewer of one run; ``decode`` gives token texts (``tokenizer_decoder`` unless a test passes its own)."""
    templates = Jinja2Templates(directory=str(TEMPLATES))
    templates.env.filters["num"] = lambda v, d=3: "" if v is None else f"{v:+.{d}f}" if isinstance(v, float) else v
    app = FastAPI(title=f"PettingFlow trajectories: {layout.run_id}", docs_url=None, redoc_url=None)
    decoder = decode if decode is not None else tokenizer_decoder(layout)

    def page(request: Request, name: str, **context: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, name, {"run": run_overview(layout), **context})

    def not_found(exc: Exception) -> HTTPException:
        return HTTPException(status_code=404, detail=str(exc))

    @app.get("/")
    def index() -> RedirectResponse:
        iterations = layout.iterations()
        if not iterations:
            raise HTTPException(status_code=404, detail=f"run {layout.run_id} has no iterations under {layout.run_uri}")
        return RedirectResponse(f"/iteration/{iterations[-1]}")

    @app.get("/iteration/{k}", response_class=HTMLResponse)
    def iteration(
        request: Request,
        k: int,
        attempt: int = 0,
        step: str = StepName.ROLLOUTS,
        agent: str = "",
        env: str = "",
        outcome: str = "",
        min_reward: str = "",
        max_reward: str = "",
    ) -> HTMLResponse:
        chosen = EpisodeFilter(
            agent=agent,
            env=env,
            outcome=outcome,
            min_reward=float(min_reward) if min_reward.strip() else None,
            max_reward=float(max_reward) if max_reward.strip() else None,
        )
        try:
            episodes = load_episodes(layout, k, attempt, step)
        except (StepNotCommittedError, FileNotFoundError, ValueError) as exc:
            raise not_found(exc) from exc
        shown = [e for e in episodes if chosen.keeps(e)]
        return page(
            request,
            "iteration.html",
            k=k,
            attempt=attempt,
            step=step,
            steps=VIEW_STEPS,
            attempts=layout.attempts(k),
            episodes=shown,
            total=len(episodes),
            agents=sorted({a for e in episodes for a in e.agents}),
            envs=sorted({e.env for e in episodes}),
            # every label, so "failed" can be asked for where none did; then any other value the rows hold
            outcomes=[*OUTCOME_LABELS.values(), *sorted({e.outcome for e in episodes} - set(OUTCOME_LABELS.values()))],
            filter=chosen,
            min_reward=min_reward,
            max_reward=max_reward,
        )

    @app.get("/episode/{k}/{e}", response_class=HTMLResponse)
    def episode(request: Request, k: int, e: int, attempt: int = 0, step: str = StepName.ROLLOUTS) -> HTMLResponse:
        try:
            found = load_episodes(layout, k, attempt, step, decode=decoder, episode=e)
        except (StepNotCommittedError, FileNotFoundError, ValueError) as exc:
            raise not_found(exc) from exc
        if not found:
            raise HTTPException(status_code=404, detail=f"no episode {e} in iter-{k} {step}")
        ep = found[0]
        by_turn: dict[int, list] = {}
        for t in ep.turns:
            by_turn.setdefault(t.turn_idx, []).append(t)
        return page(request, "episode.html", k=k, attempt=attempt, step=step, episode=ep, by_turn=by_turn)

    @app.get("/compare/{k}", response_class=HTMLResponse)
    def compare(request: Request, k: int, a: int = 0, b: int = 1) -> HTMLResponse:
        attempts = layout.attempts(k)
        missing = [x for x in (a, b) if x not in attempts]
        if missing:
            raise HTTPException(status_code=404, detail=f"iter-{k} has attempts {attempts}, not {missing}")
        try:
            data = compare_attempts(layout, k, a, b)
        except (StepNotCommittedError, FileNotFoundError) as exc:
            raise not_found(exc) from exc
        return page(request, "compare.html", k=k, a=a, b=b, attempts=attempts, **data)

    return app


def serve(layout: RunLayout, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Serve the viewer until interrupted; refuses a non-loopback address (the viewer has no login)."""
    import uvicorn

    if not is_loopback(host):
        raise ValueError(
            f"--host {host}: the viewer has no login, so it serves on loopback only (127.0.0.1 or ::1); "
            f"to open it from another machine, tunnel: ssh -L {port}:127.0.0.1:{port} <this machine>"
        )
    uvicorn.run(create_app(layout), host=host, port=port, log_level="warning")
