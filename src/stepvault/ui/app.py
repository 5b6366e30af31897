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
import functools
import json
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .._units import format_time, human_bytes
from ..errors import CheckpointNotFoundError, InvalidNameError, RegistryError, StepvaultError
from . import data
from .actions import ACTION_HEADER, ACTIONS
from .security import GuardMiddleware

HERE = Path(__file__).resolve().parent
#: Seconds between two polls of /api/changes by an open page.
DEFAULT_REFRESH = 2.0
#: Rows of the run page's checkpoint table (newest first); the charts and the JSON have all.
RUN_TABLE_ROWS = 200
#: Page results kept in memory (each valid until the store changes).
MEMO_ENTRIES = 64
#: Seconds a page result is reused at most, even when the store's change token is the same.
MEMO_SECONDS = 30.0


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    env = templates.env
    env.filters["bytes"] = human_bytes
    env.filters["when"] = functools.partial(format_time, missing="")
    env.filters["num"] = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else v)
    env.globals["json"] = lambda v: json.dumps(v, sort_keys=True, default=str)
    return templates


class Dashboard:
    """The routes of one dashboard over one store."""

    def __init__(
        self, root: str, *, allow_actions: bool = False, refresh_seconds: float = DEFAULT_REFRESH
    ) -> None:
        self.reader = data.StoreReader(str(root), writable=False)
        self.writer = data.StoreReader(str(root), writable=True) if allow_actions else None
        self.allow_actions = allow_actions
        self.refresh_seconds = refresh_seconds
        self.templates = _templates()
        self._cache: dict[tuple[str, str], tuple[str, float, Any]] = {}
        self.reader.view()  # fail at start, not on the first page, when there is no store

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
        started = time.monotonic()
        doc = fn(*args)
        if len(self._cache) >= MEMO_ENTRIES:
            self._cache.clear()
        self._cache[key] = (token, started, doc)
        return doc

    def _page(self, request: Request, template: str, title: str, **context: Any) -> Response:
        return self.templates.TemplateResponse(
            request,
            template,
            {
                "title": title,
                "refresh": self.refresh_seconds,
                "allow_actions": self.allow_actions,
                "url": self.reader.root,
                **context,
            },
        )

    # -- pages ---------------------------------------------------------------------------
    async def store_page(self, request: Request) -> Response:
        doc = await self._call(data.store_overview, self.reader)
        return self._page(request, "store.html", "store", doc=doc)

    async def run_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        doc = await self._call(data.run_detail, self.reader, run)
        return self._page(
            request,
            "run.html",
            f"run {run}",
            doc=doc,
            params=request.query_params,
            table_rows=RUN_TABLE_ROWS,
        )

    async def checkpoint_page(self, request: Request) -> Response:
        run = request.path_params["run"]
        step = data.parse_step(request.path_params["step"])
        doc = await self._call(data.checkpoint_detail, self.reader, run, step)
        return self._page(request, "checkpoint.html", f"{run}@{step}", doc=doc)

    async def registry_page(self, request: Request) -> Response:
        doc = await self._call(data.registry_overview, self.reader)
        return self._page(request, "registry.html", "registry", doc=doc)

    async def events_page(self, request: Request) -> Response:
        run, kind = self._event_filter(request)
        doc = await self._call(data.events_page, self.reader, run, kind)
        return self._page(request, "events.html", "events", doc=doc)

    @staticmethod
    def _event_filter(request: Request) -> tuple[str | None, str | None]:
        run = request.query_params.get("run") or None
        kind = request.query_params.get("kind") or None
        if kind is not None and (len(kind) > 64 or not kind.replace("_", "").isalnum()):
            raise InvalidNameError(f"bad event kind {kind[:40]!r}")
        return run, kind

    # -- JSON ----------------------------------------------------------------------------
    async def api_store(self, request: Request) -> Response:
        return JSONResponse(await self._call(data.store_overview, self.reader))

    async def api_run(self, request: Request) -> Response:
        return JSONResponse(
            await self._call(data.run_detail, self.reader, request.path_params["run"])
        )

    async def api_retention(self, request: Request) -> Response:
        params = dict(request.query_params)
        doc = await self._call(
            data.retention_preview, self.reader, request.path_params["run"], params
        )
        return JSONResponse(doc)

    async def api_checkpoint(self, request: Request) -> Response:
        step = data.parse_step(request.path_params["step"])
        doc = await self._call(
            data.checkpoint_detail, self.reader, request.path_params["run"], step
        )
        return JSONResponse(doc)

    async def api_registry(self, request: Request) -> Response:
        return JSONResponse(await self._call(data.registry_overview, self.reader))

    async def api_events(self, request: Request) -> Response:
        run, kind = self._event_filter(request)
        return JSONResponse(await self._call(data.events_page, self.reader, run, kind))

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
            Route("/registry", self.registry_page),
            Route("/events", self.events_page),
            Route("/api/store", self.api_store),
            Route("/api/runs/{run}", self.api_run),
            Route("/api/runs/{run}/retention", self.api_retention),
            Route("/api/runs/{run}/checkpoints/{step}", self.api_checkpoint),
            Route("/api/registry", self.api_registry),
            Route("/api/events", self.api_events),
            Route("/api/changes", self.api_changes),
            Route("/api/actions/{name}", self.api_action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ]


def _error_handler(status: int):
    async def handle(request: Request, exc: Exception) -> Response:
        message = str(exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status)
        body = (
            "<!doctype html><meta charset=utf-8><title>stepvault</title>"
            f"<p>{_escape(message)}</p><p><a href='/'>store</a></p>"
        )
        return Response(body, status, media_type="text/html")

    return handle


def _escape(text: str) -> str:
    from html import escape

    return escape(text, quote=True)


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
    bad_request, not_found = _error_handler(400), _error_handler(404)
    return Starlette(
        routes=dash.routes(),
        middleware=[Middleware(GuardMiddleware, token=token, loopback_only=loopback_only)],
        exception_handlers={
            InvalidNameError: bad_request,
            ValueError: bad_request,
            CheckpointNotFoundError: not_found,
            RegistryError: not_found,
            StepvaultError: bad_request,
        },
    )
