"""The Starlette application: :func:`create_app` wires the store, the workflows, the pages,
the JSON API and (only when allowed) the actions.

Every error a request can cause becomes a 4xx with a one-line message (JSON under
``/api``, a page elsewhere): :class:`~flowloop.ui.queries.BadInput` → 400,
:class:`~flowloop.ui.queries.NotFound` → 404, any other ``FlowloopError`` → 400 (a user
mistake, the CLI's exit 2) or 409 (a failure, exit 1), a database that cannot be reached →
503. A traceback is never sent to the browser.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote

from sqlalchemy.exc import DataError, SQLAlchemyError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from flowloop import ids
from flowloop.definition import Workflow
from flowloop.engine import Engine
from flowloop.errors import EXIT_USAGE, FlowloopError, StoreError, UnknownLoop, UnknownRun
from flowloop.loops import Loop
from flowloop.store.sql import SQLStore
from flowloop.ui import actions, api, pages
from flowloop.ui.diagrams import Machines, SvgCache
from flowloop.ui.paths import RUN_PATHS, EncodedSlashes, segment
from flowloop.ui.queries import NUL, BadInput, NotFound
from flowloop.ui.security import HEADERS, SecurityHeaders

HERE: Final = Path(__file__).resolve().parent
LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Host headers the dashboard answers by default (the port is not part of the match)."""
log = logging.getLogger("flowloop.ui")


@dataclass(kw_only=True)
class Dashboard:
    """What every request handler reaches through ``request.app.state.dash``."""

    store: SQLStore
    workflows: Mapping[str, Workflow]
    loops: Mapping[str, Loop] = field(default_factory=dict)
    allow_actions: bool = False
    token: str | None = None
    engine: Engine | None = None
    """The engine actions call (only with ``allow_actions``)."""
    svgs: SvgCache = field(default_factory=SvgCache)
    machines: Machines = field(init=False)

    def __post_init__(self) -> None:
        self.machines = Machines(self.store, self.workflows)

    @property
    def db(self) -> Any:
        return self.store.engine


def dashboard(request: Request) -> Dashboard:
    dash: Dashboard = request.app.state.dash
    return dash


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _status_for(error: BaseException) -> int:
    if isinstance(error, NotFound | UnknownRun | UnknownLoop):
        return 404
    if isinstance(error, BadInput):
        return 400
    if isinstance(error, actions.Forbidden):
        return 403
    if isinstance(error, StoreError):
        return 503
    if isinstance(error, FlowloopError):
        # The CLI's exit 2 (the request was wrong) or 1 (it could not be done now).
        return 400 if error.exit_code == EXIT_USAGE else 409
    return 500


def _error_response(request: Request, status: int, message: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"error": message, "status": status}, status_code=status)
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(
        request, "error.html", {"status": status, "message": message}, status_code=status
    )


async def _on_flowloop_error(request: Request, error: Exception) -> Response:
    if isinstance(error, NotFound | UnknownRun) and request.method == "GET":
        try:
            whole = _whole_run_url(request)
        except ids.AmbiguousRunId as ambiguous:  # said as the CLI says it, not "no run"
            return _error_response(request, 400, str(ambiguous))
        if whole is not None:
            return RedirectResponse(whole, status_code=307)
    return _error_response(request, _status_for(error), str(error))


def _whole_run_url(request: Request) -> str | None:
    """The URL asked for with its run id made whole, when it names a run by a unique prefix
    (as the CLI takes and `status` prints): its page and API paths alike, the query kept.
    ``None`` when no run starts with it; AmbiguousRunId when several do."""
    given = str(request.path_params.get("run_id", ""))
    if not given or NUL in given:  # no id holds one (PostgreSQL refuses to look)
        return None
    try:
        whole = ids.resolve(request.app.state.dash.store, given)
    except ids.AmbiguousRunId:
        raise
    except FlowloopError:  # none, or too short
        return None
    if whole == given:
        return None
    # The path as routed (EncodedSlashes keeps %2F and %25 in it; the rest decoded): the
    # id's segment is the one after /runs/ or /api/runs/, put back encoded whole.
    # (Replacing the decoded id in it found nothing for an id with / or %: a redirect to
    # itself; and left the whole id's / unencoded: a wrong address.)
    path, root = str(request.scope["path"]), str(request.scope.get("root_path", ""))
    root = root if root and path.startswith(root) else ""
    routed = path[len(root) :]
    prefix = next((p for p in RUN_PATHS if routed.startswith(p)), None)
    if prefix is None:
        return None
    sent, slash, rest = routed[len(prefix) :].partition("/")
    if unquote(sent) != given:  # (not the id the route took: no redirect, not a loop)
        return None
    moved = f"{root}{prefix}{segment(whole)}{slash}{rest}"
    return moved + (f"?{request.url.query}" if request.url.query else "")


async def _on_http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = {404: "no such page", 405: "method not allowed"}.get(
        error.status_code, str(error.detail)
    )
    return _error_response(request, error.status_code, message)


async def _on_database_error(request: Request, error: Exception) -> Response:
    if isinstance(error, DataError):  # a value the database refuses (a NUL in a field)
        first = str(getattr(error, "orig", error)).strip().splitlines()[0][:200]
        # Logged too: a value the client gave, usually — or a damaged stored row.
        log.info("database refused a value on %s: %s", request.url.path, first)
        return _error_response(request, 400, f"the database refused a value given: {first}")
    log.warning("database error on %s: %s", request.url.path, str(error).splitlines()[0])
    return _error_response(request, 503, "the database could not answer; try again")


async def _on_bug(request: Request, error: Exception) -> Response:
    log.exception("error on %s", request.url.path)
    message = f"internal error ({type(error).__name__}); see the log"
    response = _error_response(request, 500, message)
    # Starlette answers an error outside every middleware (SecurityHeaders too): said here.
    response.headers.update({name.decode(): value.decode() for name, value in HEADERS})
    return response


def _fmt_duration(value: float | None) -> str:
    if value is None:
        return "\u2013"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _fmt_until(seconds: float) -> str:
    """A time to come as "in 59 min" (``static/app.js`` counts it down the same way)."""
    if seconds <= 0:
        return "due now"
    if seconds < 60:
        return f"in {math.ceil(seconds)} s"
    if seconds < 5400:
        return f"in {math.floor(seconds / 60 + 0.5)} min"
    if seconds < 172_800:
        return f"in {seconds / 3600:.1f} h"
    return f"in {seconds / 86400:.1f} d"


def create_app(
    store: SQLStore,
    *,
    workflows: Mapping[str, Workflow] | None = None,
    loops: Mapping[str, Loop] | None = None,
    allow_actions: bool = False,
    token: str | None = None,
    engine: Engine | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
) -> Starlette:
    """The dashboard over ``store``. Read-only unless ``allow_actions``; then every action
    needs ``token`` (one is made when not given: read it from ``app.state.dash.token``)
    and ``engine`` carries them out (one over the same store when not given).

    Requests must name one of ``allowed_hosts`` in their Host header (loopback names by
    default): reads need no token, so a page on another site that rebinds its own name to
    127.0.0.1 (DNS rebinding) must not be able to read runs and their contexts."""
    if allow_actions:
        token = token or secrets.token_urlsafe(24)
        if engine is None:
            engine = Engine(store.url, store=store, workflows=(workflows or {}).values())
    dash = Dashboard(
        store=store,
        workflows=dict(workflows or {}),
        loops=dict(loops or {}),
        allow_actions=allow_actions,
        token=token if allow_actions else None,
        engine=engine if allow_actions else None,
    )
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals.update(
        fmt_time=pages.fmt_time,
        fmt_duration=_fmt_duration,
        fmt_until=_fmt_until,
        num=lambda n: f"{n:,}" if isinstance(n, int) else str(n),
        allow_actions=allow_actions,
    )
    templates.env.filters["json_text"] = pages.json_text
    templates.env.filters["cut"] = pages.cut
    templates.env.filters["cut_head"] = pages.cut_head
    templates.env.filters["seg"] = segment  # a run id in a link: one path segment
    routes = [
        *pages.routes(),
        *api.routes(),
        *(actions.routes() if allow_actions else []),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(EncodedSlashes),
            Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
        ],
        exception_handlers={
            FlowloopError: _on_flowloop_error,
            HTTPException: _on_http_error,
            SQLAlchemyError: _on_database_error,
            Exception: _on_bug,
        },
    )
    app.state.dash = dash
    app.state.templates = templates
    return app
