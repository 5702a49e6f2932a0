"""The dashboard's web app (FastAPI + Jinja2 server-rendered pages, uPlot charts, polling for live updates).

Pages (every URL names what it shows, so it can be shared)::

    /                                                        runs, search by rollout id, gateway link
    /runs/{run}                                              config, status, held-out accuracy, curves, steps
    /runs/{run}/steps/{step}                                 the step's GRPO groups
    /runs/{run}/steps/{step}/groups/{group}                  a group's rollouts: rewards, advantages, status
    /runs/{run}/steps/{step}/groups/{group}/rollouts/{rid}   calls (paged) and rows of a rollout
    .../rollouts/{rid}/rows/{k}?page=P                       one row's tokens (paged), its merge break
    /rollouts/{rid}, /rollouts/{rid}/rows/{k}                the same for any rollout (search, evals)
    /gateway                                                 live replicas, paused / held / in flight, policy
    /api/runs, /api/runs/{run}, /api/gateway                 what the pages poll (JSON)

Bad input (an unknown run, step, group, rollout or row; Redis unreachable) gets a page saying so with a
404 or 503 status, never a traceback; a run whose ``config.json`` holds settings TrainConfig refuses is shown with
the defaults, and its pages say which (:func:`~agl_trainer.ui.traces.checked_settings`).

Run directories are read in worker threads, never on the event loop, and kept until their files change
(:class:`~agl_trainer.ui.runs.RunCache`): a long run (100,000 steps, 24 MB of metrics) neither blocks the other
pages nor is parsed again on every poll, and its page and JSON are bounded (:meth:`~agl_trainer.ui.runs.Run.to_json`).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agl_common.settings import redacted_url
from agl_common.store import RolloutNotFound, Store, UnreadableRecord
from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..algorithm.aggregate import Vocabulary
from .runs import EVALS_SHOWN, MAX_POINTS, STEP_COLUMNS, STEPS_SHOWN, Run, RunCache, find_run, find_runs, step_groups
from .traces import EVENTS_SHOWN, TraceCache, checked_settings, event_lines, group_view, logprob_colour, message_text

HERE = Path(__file__).parent
#: Calls per page of a rollout's calls table, tokens per page of a row's token view.
CALLS_PER_PAGE = 100
ROWS_PER_PAGE = 200
TOKENS_PER_PAGE = 1024
#: How often (ms) the run list, run page and gateway page poll for changes.
POLL_MS = 2000


class PageError(Exception):
    """A request the dashboard cannot answer: rendered as a page with ``status``, ``title`` and ``message``."""

    def __init__(self, status: int, title: str, message: str):
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


def create_app(redis_url: str, prefix: str, runs_dir: Path, decoder: Vocabulary | None = None) -> FastAPI:
    """The dashboard app reading Redis at ``redis_url`` (keys under ``prefix``) and the run directories
    under ``runs_dir``. ``decoder`` turns token ids into text (None: ids are shown as numbers)."""
    runs_dir = Path(runs_dir)
    decoder = decoder or Vocabulary()
    store = Store(redis_url, prefix, max_connections=32)
    redis_url = redacted_url(redis_url)  # only ever shown from here on: never its password
    traces = TraceCache(store, decoder)
    run_cache = RunCache()
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals.update(poll_ms=POLL_MS, redis_url=redis_url, prefix=prefix, runs_dir=str(runs_dir),
                                 quote=quote, STEP_COLUMNS=STEP_COLUMNS, STEPS_SHOWN=STEPS_SHOWN,
                                 MAX_POINTS=MAX_POINTS, EVALS_SHOWN=EVALS_SHOWN)
    templates.env.filters["fmt"] = _fmt

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await store.close()

    app = FastAPI(title="AGL dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def page(request: Request, name: str, status: int = 200, **ctx) -> HTMLResponse:
        return templates.TemplateResponse(request, name, ctx, status_code=status)

    # ------------------------------------------------------------------ errors: a page, never a traceback
    def error_page(request: Request, status: int, title: str, message: str):
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": {"title": title, "message": message}}, status_code=status)
        return page(request, "error.html", status, title=title, message=message)

    @app.exception_handler(PageError)
    async def on_page_error(request: Request, exc: PageError):
        return error_page(request, exc.status, exc.title, exc.message)

    @app.exception_handler(RedisError)
    async def on_redis_error(request: Request, exc: RedisError):
        return error_page(request, 503, "Redis is not reachable",
                          f"The dashboard reads rollouts and calls from Redis at {redis_url} (prefix {prefix!r}) and "
                          f"could not: {type(exc).__name__}: {str(exc).rstrip('.')}. Start Redis or pass --redis URL; "
                          f"run pages that only need {runs_dir} still work.")

    @app.exception_handler(UnreadableRecord)
    async def on_unreadable(request: Request, exc: UnreadableRecord):  # (another version's record, or a hand's)
        return error_page(request, 500, "Unreadable record", f"{exc}.")

    @app.exception_handler(RequestValidationError)
    async def on_bad_parameter(request: Request, exc: RequestValidationError):
        if request.url.path.startswith("/api/"):  # API clients get FastAPI's JSON 422
            return await request_validation_exception_handler(request, exc)
        wrong = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'value'}: {e.get('msg', '')}"
                          for e in exc.errors()[:3])
        return error_page(request, 400, "Bad request", f"{request.url.path}: {wrong}.")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_page(request, 404, "Page not found", f"Nothing is served at {request.url.path}.")
        return error_page(request, exc.status_code, "Bad request", str(exc.detail))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        return error_page(request, 500, "Internal error",
                          f"{type(exc).__name__}: {exc}. The server's log has the details.")

    # ------------------------------------------------------------------ lookups
    # (the run directories are read in worker threads: a long run's metrics take seconds to parse)
    def read_run(run_id: str) -> Run:
        """The run named ``run_id`` (through the cache). Raises :class:`PageError` (404) for an unknown one."""
        run = find_run(runs_dir, run_id, run_cache)
        if run is None:
            known = ", ".join(p.name for p in find_runs(runs_dir)[:10]) or "none"
            raise PageError(404, "Unknown run", f"No run directory named {run_id!r} under {runs_dir} "
                                                f"(runs there: {known}).")
        return run

    async def get_run(run_id: str) -> Run:
        return await run_in_threadpool(read_run, run_id)

    async def all_runs() -> list[Run]:
        return await run_in_threadpool(lambda: [run_cache.get(p) for p in find_runs(runs_dir)])

    def get_step(run: Run, step: int) -> dict:
        m = run.step(step)
        if m is None:
            numbers = [str(s.get("step")) for s in run.steps]
            if len(numbers) > 20:  # (a long run: its first and last steps, not 100,000 numbers)
                numbers = [*numbers[:10], f"… {len(numbers) - 20:,} more …", *numbers[-10:]]
            raise PageError(404, "Unknown step", f"Run {run.run_id} has no step {step} in its metrics.jsonl "
                                                 f"(steps: {', '.join(numbers) or 'none'}).")
        return m

    def run_settings_of(run: Run | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The run's settings and those its config.json holds that TrainConfig refuses (shown as replaced)."""
        return checked_settings(run.config if run is not None else {})

    async def get_rollout(rid: str):
        try:
            return await store.get_rollout(rid)
        except RolloutNotFound:
            raise PageError(404, "Unknown rollout", f"No rollout {rid!r} in Redis at {redis_url} "
                                                    f"(prefix {prefix!r}).") from None

    async def group_rollouts(gid: str) -> list:
        info = (await store.groups([gid]))[0]
        if info is None:  # every group a run trains is registered (the scheduler's); a name in a hand-edited
            # metrics.jsonl, or one whose record is gone, has none: no scan of every rollout of the prefix (round 20)
            return []
        return await store.get_rollouts(info.rollout_ids, skip_missing=True)

    async def group_summary(run: Run, gid: str) -> dict[str, Any]:
        settings, _ = run_settings_of(run)
        rollouts = await group_rollouts(gid)
        tr = {r.rollout_id: await traces.summary(r, settings) for r in rollouts}
        view = group_view(rollouts, tr, settings)
        return {"group_id": gid, "rollouts": rollouts, "traces": tr, **view,
                "input": rollouts[0].input if rollouts else None}

    def crumbs(run: Run | None = None, step: int | None = None, gid: str | None = None, rid: str | None = None):
        out = [("runs", "/")]
        if run is not None:
            base = f"/runs/{quote(run.run_id)}"
            out.append((f"run {run.run_id}", base))
            if step is not None:
                base += f"/steps/{step}"
                out.append((f"step {step}", base))
                if gid is not None:
                    base += f"/groups/{quote(gid)}"
                    out.append((f"group {gid}", base))
        if rid is not None:
            out.append((f"rollout {rid}", rollout_url(run, step, gid, rid)))
        return out

    # ------------------------------------------------------------------ pages
    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request):
        return page(request, "index.html", runs=await all_runs(), crumbs=crumbs())

    @app.get("/search")
    async def search(request: Request, q: str = ""):
        rid = q.strip()
        if not rid:
            raise PageError(400, "Empty search", "Type a rollout id to search for.")
        rollout = await get_rollout(rid)
        info = (await store.groups([rollout.group_id]))[0] if rollout.group_id else None

        def trained_at() -> tuple[Run, Any] | None:  # (a worker thread: a long run has many steps to look through)
            run = find_run(runs_dir, info.run, run_cache) if info is not None and info.run is not None else None
            for m in run.steps if run is not None else []:
                if rollout.group_id in step_groups(m):
                    return run, m["step"]
            return None

        found = await run_in_threadpool(trained_at)
        if found is not None:
            return RedirectResponse(rollout_url(found[0], found[1], rollout.group_id, rid), status_code=303)
        return RedirectResponse(rollout_url(None, None, None, rid), status_code=303)

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run_page(request: Request, run_id: str):
        def read() -> tuple[Run, dict[str, Any]]:  # (a worker thread: a long run's curves take a while)
            run = read_run(run_id)
            return run, run.to_json()

        run, data = await run_in_threadpool(read)
        return page(request, "run.html", run=run, data=data, settings_refused=run_settings_of(run)[1],
                    crumbs=crumbs(run))

    @app.get("/runs/{run_id}/steps/{step}", response_class=HTMLResponse)
    async def step_page(request: Request, run_id: str, step: int):
        run = await get_run(run_id)
        m = get_step(run, step)
        groups = [await group_summary(run, gid) for gid in step_groups(m)]
        return page(request, "step.html", run=run, step=step, m=m, groups=groups,
                    settings_refused=run_settings_of(run)[1], crumbs=crumbs(run, step))

    @app.get("/runs/{run_id}/steps/{step}/groups/{gid}", response_class=HTMLResponse)
    async def group_page(request: Request, run_id: str, step: int, gid: str):
        run = await get_run(run_id)
        m = get_step(run, step)
        if gid not in step_groups(m):
            raise PageError(404, "Unknown group", f"Step {step} of run {run_id} trained no group {gid!r}.")
        if (await store.groups([gid]))[0] is None:
            raise PageError(404, "Unknown group", f"No group {gid!r} is registered in Redis at {redis_url} "
                                                  f"(prefix {prefix!r}).")
        g = await group_summary(run, gid)
        return page(request, "group.html", run=run, step=step, g=g, settings_refused=run_settings_of(run)[1],
                    crumbs=crumbs(run, step, gid))

    async def rollout_context(run_id, step, gid, rid):
        run = await get_run(run_id) if run_id is not None else None
        if run is not None and step is not None:
            get_step(run, step)
        rollout = await get_rollout(rid)
        if gid is not None and rollout.group_id != gid:
            raise PageError(404, "Unknown rollout", f"Rollout {rid!r} is not in group {gid!r}.")
        settings, refused = run_settings_of(run)
        trace = await traces.get(rollout, settings)
        return run, rollout, trace, refused

    async def rollout_page(request, run_id, step, gid, rid, page_no: int, rows_page: int):
        run, rollout, trace, refused = await rollout_context(run_id, step, gid, rid)
        n_pages = max(1, math.ceil(len(trace.calls) / CALLS_PER_PAGE))
        if not 1 <= page_no <= n_pages:
            raise PageError(404, "No such page", f"Rollout {rid} has {len(trace.calls)} calls: pages 1 to {n_pages}.")
        n_row_pages = max(1, math.ceil(len(trace.rows) / ROWS_PER_PAGE))
        if not 1 <= rows_page <= n_row_pages:
            raise PageError(404, "No such page", f"Rollout {rid} has {len(trace.rows)} rows: row pages 1 to "
                                                 f"{n_row_pages}.")
        calls = trace.calls[(page_no - 1) * CALLS_PER_PAGE: page_no * CALLS_PER_PAGE]
        row_lo = (rows_page - 1) * ROWS_PER_PAGE
        rows = list(enumerate(trace.rows))[row_lo: row_lo + ROWS_PER_PAGE]
        base = rollout_url(run, step, gid, rid)
        adv = None
        if run is not None and step is not None and gid is not None:
            adv = (await group_summary(run, gid))["advantages"].get(rid)
        n_events, events = await store.recent_events(rid, EVENTS_SHOWN)
        return page(request, "rollout.html", run=run, step=step, gid=gid, rollout=rollout, trace=trace,
                    calls=calls, page_no=page_no, n_pages=n_pages, base=base, advantage=adv, rows=rows,
                    rows_page=rows_page, n_row_pages=n_row_pages, events=event_lines(events), n_events=n_events,
                    message_text=message_text, settings_refused=refused, crumbs=crumbs(run, step, gid, rid))

    async def row_page(request, run_id, step, gid, rid, k: int, page_no: int):
        run, rollout, trace, refused = await rollout_context(run_id, step, gid, rid)
        if not 0 <= k < len(trace.rows):
            raise PageError(404, "Unknown row", f"Rollout {rid} has {len(trace.rows)} row(s) (0 to "
                                                f"{len(trace.rows) - 1}), not row {k}.")
        row = trace.rows[k]
        ids = row.full_ids()
        n_prompt = len(row.prompt_ids)
        n_pages = max(1, math.ceil(len(ids) / TOKENS_PER_PAGE))
        if not 1 <= page_no <= n_pages:
            raise PageError(404, "No such page", f"Row {k} has {len(ids)} tokens: pages 1 to {n_pages}.")
        brk = trace.breaks.get(k)
        lo = (page_no - 1) * TOKENS_PER_PAGE
        tokens = []
        for i in range(lo, min(len(ids), lo + TOKENS_PER_PAGE)):
            if i < n_prompt:
                kind, lp, colour = "prompt", None, ""
            else:
                j = i - n_prompt
                trainable = row.response_mask[j] == 1
                kind = "sampled" if trainable else "context"
                lp = row.old_logprobs[j] if trainable and row.has_logprobs else None
                colour = logprob_colour(lp) if lp is not None else ""
            tokens.append({"i": i, "id": ids[i], "text": decoder.piece(ids[i]), "kind": kind, "lp": lp,
                           "colour": colour, "brk": brk is not None and i == brk["position"]})
        base = rollout_url(run, step, gid, rid)
        return page(request, "row.html", run=run, step=step, gid=gid, rollout=rollout, trace=trace, k=k, row=row,
                    tokens=tokens, page_no=page_no, n_pages=n_pages, brk=brk, base=base,
                    brk_page=(brk["position"] // TOKENS_PER_PAGE + 1) if brk else None,
                    n_sampled=sum(row.response_mask), n_context=len(row.response_mask) - sum(row.response_mask),
                    settings_refused=refused,
                    crumbs=crumbs(run, step, gid, rid) + [(f"row {k}", f"{base}/rows/{k}")])

    async def call_page(request, run_id, step, gid, rid, aid: str, seq: int):
        run, rollout, trace, refused = await rollout_context(run_id, step, gid, rid)
        found = [c for c in trace.calls if c.attempt_id == aid and c.seq == seq]
        if not found:
            raise PageError(404, "Unknown call", f"Rollout {rid} has no call {seq} in attempt {aid} "
                                                 f"({len(trace.calls)} calls recorded).")
        base = rollout_url(run, step, gid, rid)
        return page(request, "call.html", rollout=rollout, c=found[0], base=base, said=message_text(found[0]),
                    row_k=trace.row_of_call.get((aid, seq)), settings_refused=refused,
                    crumbs=crumbs(run, step, gid, rid) + [(f"call {aid}/{seq}", f"{base}/calls/{aid}/{seq}")])

    @app.get("/runs/{run_id}/steps/{step}/groups/{gid}/rollouts/{rid}", response_class=HTMLResponse)
    async def nested_rollout(request: Request, run_id: str, step: int, gid: str, rid: str, page: int = 1,
                             rpage: int = 1):
        return await rollout_page(request, run_id, step, gid, rid, page, rpage)

    @app.get("/runs/{run_id}/steps/{step}/groups/{gid}/rollouts/{rid}/calls/{aid}/{seq}",
             response_class=HTMLResponse)
    async def nested_call(request: Request, run_id: str, step: int, gid: str, rid: str, aid: str, seq: int):
        return await call_page(request, run_id, step, gid, rid, aid, seq)

    @app.get("/rollouts/{rid}/calls/{aid}/{seq}", response_class=HTMLResponse)
    async def plain_call(request: Request, rid: str, aid: str, seq: int):
        return await call_page(request, None, None, None, rid, aid, seq)

    @app.get("/runs/{run_id}/steps/{step}/groups/{gid}/rollouts/{rid}/rows/{k}", response_class=HTMLResponse)
    async def nested_row(request: Request, run_id: str, step: int, gid: str, rid: str, k: int, page: int = 1):
        return await row_page(request, run_id, step, gid, rid, k, page)

    @app.get("/rollouts/{rid}", response_class=HTMLResponse)
    async def plain_rollout(request: Request, rid: str, page: int = 1, rpage: int = 1):
        return await rollout_page(request, None, None, None, rid, page, rpage)

    @app.get("/rollouts/{rid}/rows/{k}", response_class=HTMLResponse)
    async def plain_row(request: Request, rid: str, k: int, page: int = 1):
        return await row_page(request, None, None, None, rid, k, page)

    @app.get("/gateway", response_class=HTMLResponse)
    async def gateway_page(request: Request):
        return page(request, "gateway.html", gw=await gateway_state(), crumbs=crumbs() + [("gateway", "/gateway")])

    # ------------------------------------------------------------------ JSON the pages poll
    async def gateway_state() -> dict[str, Any]:
        replicas = sorted(await store.replicas(), key=lambda r: r.replica_id)
        policy = await store.get_policy()
        return {"policy": policy.model_dump() if policy else None,
                "replicas": [r.model_dump() for r in replicas],
                "paused": sum(r.paused for r in replicas), "held": sum(r.held for r in replicas),
                "in_flight": sum(r.in_flight for r in replicas)}

    @app.get("/api/gateway")
    async def api_gateway():
        return await gateway_state()

    @app.get("/api/runs")
    async def api_runs():
        return [{"run_id": r.run_id, "name": r.name, "status": r.status, "steps": len(r.steps),
                 "before": r.eval_accuracy("before"), "after": r.eval_accuracy("after")}
                for r in await all_runs()]

    @app.get("/api/runs/{run_id}")
    async def api_run(run_id: str, since: str | None = None):
        """The run page's data (:meth:`Run.to_json`); ``since``: the ``version`` the page has: when the run's files
        are still that version, only ``{run_id, status, version, unchanged: true}``."""
        def answer() -> bytes:  # (a worker thread: reading, and encoding, a long run's data take a while)
            run = read_run(run_id)
            data = ({"run_id": run.run_id, "status": run.status, "version": run.version, "unchanged": True}
                    if since is not None and since == run.version else run.to_json())
            return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

        return Response(await run_in_threadpool(answer), media_type="application/json")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    return app


def rollout_url(run: Run | None, step: int | None, gid: str | None, rid: str) -> str:
    """The rollout page's URL: nested under its run, step and group when known."""
    if run is not None and step is not None and gid is not None:
        return f"/runs/{quote(run.run_id)}/steps/{step}/groups/{quote(gid)}/rollouts/{quote(rid)}"
    return f"/rollouts/{quote(rid)}"


def _fmt(v: Any, digits: int = 3) -> str:
    """A number for a table cell: floats with ``digits`` decimals, None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))
