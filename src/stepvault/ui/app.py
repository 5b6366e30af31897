"""The dashboard's ASGI application: pages, JSON endpoints, static files and actions.

Pages (stable URLs)::

    /                                   store: runs, sizes, savings, tiers, damage, models
    /runs/<run>                         run: timeline, metric curves, saves, retention
    /runs/<run>/checkpoints/<step>      checkpoint: tensors, changes, lineage, verify
    /registry                           models, versions, aliases and their history
    /events?run=<run>&kind=<kind>       the audit trail

Each page's data is also at ``/api/...`` under the same path (``/api/store`` for ``/``),
and ``/api/changes`` returns a token that changes when the store does (the pages poll it).
URL parts reach the store only through its validators (run names, steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import CheckpointNotFoundError, InvalidNameError, RegistryError, StepvaultError
from . import checkpoint_page, data, retention_page, run_page
from .actions import ACTION_HEADER, ACTIONS
from .reader import StoreReader, parse_step
from .security import GuardMiddleware
from .templating import templates as _templates

HERE = Path(__file__).resolve().parent
#: Seconds between two polls of /api/changes by an open page.
DEFAULT_REFRESH = 2.0
#: Rows of the run page's checkpoint table per page (newest first); the charts have all.
RUN_TABLE_ROWS = run_page.TABLE_ROWS
#: Page results kept in memory (each valid until the store changes).
MEMO_ENTRIES = 64
#: Seconds a page result is reused at most, even when the store's change token is the same.
MEMO_SECONDS = 30.0
#: Seconds between two full re-reads of every manifest and event (in between, only new
#: ones are read): damage done to a manifest after it was shown appears within this time.
RECHECK_SECONDS = 300.0


class Dashboard:
    """The routes of one dashboard over one store."""

    def __init__(
        self, root: str, *, allow_actions: bool = False, refresh_seconds: float = DEFAULT_REFRESH
    ) -> None:
        self.reader = StoreReader(str(root), writable=False)
        self.writer = StoreReader(str(root), writable=True) if allow_actions else None
        self.allow_actions = allow_actions
        self.refresh_seconds = refresh_seconds
        self.templates = _templates()
        self._cache: dict[tuple[str, str], tuple[str, float, Any]] = {}
        # Fail at start, not on the first page, when there is no store; this also starts
        # the background probe of the cold tiers (a page never waits for one).
        self.reader.probe.prepare(self.reader.hot())
        self.reader.view()
        # The retention preview's first call imports the catalog's record readers (torch):
        # done now, in the background, instead of on the first click.
        threading.Thread(target=_warm_up, name="ui-warm-up", daemon=True).start()

    # -- helpers -------------------------------------------------------------------------
    async def _call(self, fn: Any, *args: Any) -> Any:
        # Store reads are blocking file or network I/O: keep them off the event loop, so a
        # slow page never stalls the others (or the live-refresh polls).
        return await asyncio.to_thread(self._memo, fn, args)

    def _memo(self, fn: Any, args: tuple[Any, ...]) -> Any:
        """``fn(reader, *args)``, reused while the store's change token stays the same: a
        page that reads every manifest (the store's usage, a retention preview) is computed
        once per change of the store, however many tabs show it. In memory only."""
        if fn is data.change_token:
            return fn(*args)
        key = (fn.__name__, repr(args[1:]))
        token = data.change_token(self.reader)
        hit = self._cache.get(key)
        # The token sees checkpoints, events, pins and registry moves come and go, not a
        # byte changing inside a file (damage): entries also expire after MEMO_SECONDS.
        if hit is not None and hit[0] == token and time.monotonic() - hit[1] < MEMO_SECONDS:
            return hit[2]
        if time.monotonic() - self.reader.records_born >= RECHECK_SECONDS:
            self.reader.forget_records()  # re-read (and re-verify) every manifest now and then
        started = time.monotonic()
        with _gc_paused():
            doc = fn(*args)
        if len(self._cache) >= MEMO_ENTRIES:
            self._cache.clear()
        self._cache[key] = (token, started, doc)
        return doc

    def _page(
        self, request: Request, template: str, title: str, status: int = 200, **context: Any
    ) -> Response:
        return self.templates.TemplateResponse(
            request,
            template,
            status_code=status,
            context={
                "title": title,
                "refresh": self.refresh_seconds,
                "allow_actions": self.allow_actions,
                "url": self.reader.root,
                **context,
            },
        )

    # -- pages ---------------------------------------------------------------------------
    async def store_page(self, request: Request) -> Response:
        # Sent at once without the usage (every manifest parsed); the page's script asks
        # for ?usage=1, computed off the event loop and memoised like any page.
        full = request.query_params.get("usage") == "1"
        doc = await self._call(data.store_overview, self.reader, full)
        return self._page(request, "store.html", "store", doc=doc)

    async def run_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        doc = (await self._call(run_page.run_state, self.reader, run)).doc
        page_text = request.query_params.get("page", "0")
        step_text = request.query_params.get("step", "").strip()
        page = parse_step(page_text) if page_text else 0
        step = parse_step(step_text) if step_text else None
        table = run_page.table_page(doc["checkpoints"], page, step)
        return self._page(
            request,
            "run.html",
            f"run {run}",
            doc=doc,
            params=request.query_params,
            table=table,
            table_rows=RUN_TABLE_ROWS,
        )

    async def checkpoint_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        step = parse_step(request.path_params["step"])
        doc = await self._call(checkpoint_page.checkpoint_detail, self.reader, run, step)
        # A damaged checkpoint is not a page that worked: 422 with the way out on it.
        status = 422 if doc.get("error") else 200
        return self._page(request, "checkpoint.html", f"{run}@{step}", status=status, doc=doc)

    async def compare_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        step = parse_step(request.path_params["step"])
        other = request.query_params.get("with", "")
        if not other or len(other) > 300:
            raise InvalidNameError("compare needs ?with=RUN@STEP (or a step of this run)")
        doc = await self._call(checkpoint_page.compare_checkpoints, self.reader, run, step, other)
        return self._page(request, "compare.html", f"{doc['other']} → {run}@{step}", doc=doc)

    async def api_compare(self, request: Request) -> Response:
        other = request.query_params.get("with", "")
        if not other or len(other) > 300:
            raise InvalidNameError("compare needs ?with=RUN@STEP (or a step of this run)")
        step = parse_step(request.path_params["step"])
        run = request.path_params["run"]
        return JSONResponse(
            await self._call(checkpoint_page.compare_checkpoints, self.reader, run, step, other)
        )

    async def registry_page(self, request: Request) -> Response:
        doc = await self._call(data.registry_overview, self.reader)
        return self._page(request, "registry.html", "registry", doc=doc)

    async def events_page(self, request: Request) -> Response:
        run, kind, offset = self._event_filter(request)
        doc = await self._call(data.events_page, self.reader, run, kind, data.EVENTS_LIMIT, offset)
        return self._page(request, "events.html", "events", doc=doc)

    @staticmethod
    def _event_filter(request: Request) -> tuple[str | None, str | None, int]:
        run = request.query_params.get("run") or None
        kind = request.query_params.get("kind") or None
        if kind is not None and (len(kind) > 64 or not kind.replace("_", "").isalnum()):
            raise InvalidNameError(f"bad event kind {kind[:40]!r}")
        offset_text = request.query_params.get("offset", "")
        offset = parse_step(offset_text) if offset_text else 0
        return run, kind, offset

    # -- JSON ----------------------------------------------------------------------------
    async def api_store(self, request: Request) -> Response:
        return JSONResponse(await self._call(data.store_overview, self.reader))

    async def api_run(self, request: Request) -> Response:
        """The run's data; with ``?since=CURSOR`` (the ``cursor`` of the data a page has)
        only what changed since: a live page's update is a few hundred bytes per save."""
        run = request.path_params["run"]
        since = request.query_params.get("since")
        state = await self._call(run_page.run_state, self.reader, run)
        if since is None:
            # encoded once per change of the run, however many tabs load it
            if state.encoded is None:
                state.encoded = await asyncio.to_thread(_encode, state.doc)
            if "gzip" in request.headers.get("accept-encoding", ""):
                if state.gzipped is None:
                    state.gzipped = await asyncio.to_thread(gzip.compress, state.encoded, 6)
                headers = {"content-encoding": "gzip", "vary": "Accept-Encoding"}
                return Response(state.gzipped, media_type="application/json", headers=headers)
            return Response(state.encoded, media_type="application/json")
        return JSONResponse(run_page.run_delta(state, since))

    async def api_runs(self, request: Request) -> Response:
        """The names of the runs (listings only): the run page's "compare with" menu."""
        view = await asyncio.to_thread(self.reader.view)
        return JSONResponse({"runs": await asyncio.to_thread(view.list_runs)})

    async def api_retention(self, request: Request) -> Response:
        params = dict(request.query_params)
        doc = await self._call(
            retention_page.retention_preview, self.reader, request.path_params["run"], params
        )
        return JSONResponse(doc)

    async def api_checkpoint(self, request: Request) -> Response:
        step = parse_step(request.path_params["step"])
        doc = await self._call(
            checkpoint_page.checkpoint_detail, self.reader, request.path_params["run"], step
        )
        return JSONResponse(doc)

    async def api_registry(self, request: Request) -> Response:
        return JSONResponse(await self._call(data.registry_overview, self.reader))

    async def api_events(self, request: Request) -> Response:
        run, kind, offset = self._event_filter(request)
        doc = await self._call(data.events_page, self.reader, run, kind, data.EVENTS_LIMIT, offset)
        return JSONResponse(doc)

    async def api_changes(self, request: Request) -> Response:
        return JSONResponse({"token": await self._call(data.change_token, self.reader)})

    async def api_action(self, request: Request) -> Response:
        if self.writer is None:
            return JSONResponse(
                {"error": "read-only dashboard: restart it with --allow-actions"}, 403
            )
        if request.headers.get(ACTION_HEADER) != "confirm":
            return JSONResponse({"error": f"missing {ACTION_HEADER}: confirm header"}, 400)
        action = ACTIONS.get(request.path_params["name"])
        if action is None:
            return JSONResponse({"error": f"no action {request.path_params['name'][:40]!r}"}, 404)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
        writer = self.writer
        result = await asyncio.to_thread(lambda: action(writer.store(), body))
        return JSONResponse({"ok": True, **result})

    def routes(self) -> list[Any]:
        return [
            Route("/", self.store_page),
            Route("/runs/{run}", self.run_page),
            Route("/runs/{run}/checkpoints/{step}", self.checkpoint_page),
            Route("/runs/{run}/checkpoints/{step}/compare", self.compare_page),
            Route("/registry", self.registry_page),
            Route("/events", self.events_page),
            Route("/api/store", self.api_store),
            Route("/api/runs", self.api_runs),
            Route("/api/runs/{run}", self.api_run),
            Route("/api/runs/{run}/retention", self.api_retention),
            Route("/api/runs/{run}/checkpoints/{step}", self.api_checkpoint),
            Route("/api/runs/{run}/checkpoints/{step}/compare", self.api_compare),
            Route("/api/registry", self.api_registry),
            Route("/api/events", self.api_events),
            Route("/api/changes", self.api_changes),
            Route("/api/actions/{name}", self.api_action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ]

    def error_handler(self, status: int) -> Any:
        """A JSON error under /api/, else the error in the dashboard's own page."""

        async def handle(request: Request, exc: Exception) -> Response:
            message = str(exc)
            if request.url.path.startswith("/api/"):
                return JSONResponse({"error": message}, status)
            title = "not found" if status == 404 else "bad request"
            return self._page(request, "error.html", title, status=status, message=message)

        return handle


_gc_lock = threading.Lock()
_gc_users = 0


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a page's data is built: a long run's page makes
    ~100,000 small objects and no cycles, and the collector's passes over them were half of
    its time. Re-enabled when the last computation in flight ends."""
    global _gc_users
    with _gc_lock:
        _gc_users += 1
        if _gc_users == 1:
            gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0:
                gc.enable()


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _warm_up() -> None:
    with contextlib.suppress(Exception):
        import stepvault.ops.gc  # noqa: F401


def create_app(
    root: str,
    *,
    token: str | None = None,
    loopback_only: bool = True,
    allow_actions: bool = False,
    refresh_seconds: float = DEFAULT_REFRESH,
) -> Starlette:
    """The dashboard over the store at ``root`` (an ASGI app; ``stepvault ui`` serves it).

    ``token``: required on every request when set. ``loopback_only``: refuse requests whose
    Host is not a loopback name (set when bound to 127.0.0.1). ``allow_actions``: enable
    pin/unpin, annotate, promote/rollback and the gc preview; without it the store is opened
    read-only and nothing is ever written.
    """
    dash = Dashboard(root, allow_actions=allow_actions, refresh_seconds=refresh_seconds)
    bad_request, not_found = dash.error_handler(400), dash.error_handler(404)

    async def missing(request: Request, exc: Exception) -> Response:
        if getattr(exc, "status_code", 500) == 404:
            if str(exc) == "Not Found":  # starlette's own: say which page
                exc = LookupError(f"no page at {request.url.path[:200]}")
            return await not_found(request, exc)
        from starlette.exceptions import HTTPException

        assert isinstance(exc, HTTPException)
        return Response(exc.detail, exc.status_code, media_type="text/plain")

    return Starlette(
        routes=dash.routes(),
        middleware=[
            Middleware(GuardMiddleware, token=token, loopback_only=loopback_only),
            # A long run's JSON is mostly repeated keys and digits: ~10x smaller gzipped.
            Middleware(GZipMiddleware, minimum_size=1024),
        ],
        exception_handlers={
            InvalidNameError: bad_request,
            ValueError: bad_request,
            CheckpointNotFoundError: not_found,
            RegistryError: not_found,
            StepvaultError: bad_request,
            404: missing,
        },
    )
