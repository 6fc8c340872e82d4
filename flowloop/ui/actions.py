"""Operator actions from the dashboard (only with ``flowloop ui --allow-actions``).

Every action is a POST that names the token: either ``Authorization: Bearer TOKEN`` (API
clients; no cookie, so no cross-site request can carry it) or the session cookie set by
signing in at ``/login`` plus the page's CSRF field, an HMAC of the token that a page of
another site cannot read. The engine does the work (the same methods, checks and one-line
errors as the CLI) and journals who: ``operator:<user>`` for pause/stop/unpause and
``by`` = ``ui:<user>@<client>`` for a retry.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
from typing import Any, Final
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from flowloop.engine import RunInfo
from flowloop.errors import FlowloopError, UnknownLoop, UnknownRun, UnknownWorkflow
from flowloop.store.loops import LoopRow
from flowloop.ui.paths import segment
from flowloop.ui.queries import NAME_LIMIT, NUL, BadInput, NotFound

SESSION_COOKIE: Final = "flowloop_session"
RUN_ACTIONS: Final = ("pause", "unpause", "stop", "retry", "send")
LOOP_ACTIONS: Final = ("pause", "unpause", "stop")
FORM_TYPES: Final = ("application/x-www-form-urlencoded", "multipart/form-data")
RUN_FIELDS: Final = {"retry": ("from",), "send": ("event", "data", "dedupe_key")}
"""The fields each run action takes (any other is refused: a misspelt one was ignored);
pause, unpause, stop and the loop actions take none. A page's form adds ``csrf``."""
NOT_LOADED: Final = "start flowloop ui with -w FILE_OR_DIR to send events to or retry runs of it"


class Forbidden(FlowloopError):
    """The action was refused: no valid token (HTTP 403)."""


def csrf_for(token: str) -> str:
    """The CSRF value pages embed in their forms (derived from the token)."""
    return hmac.new(token.encode(), b"flowloop csrf", hashlib.sha256).hexdigest()


def flash_sign(token: str, kind: str, message: str) -> str:
    """The ``sig`` an action's redirect gives its message (``error=`` or ``done=``): a page
    shows only a message signed so, not one a link from anywhere put in its URL ("the
    token expired: paste it at …" in the dashboard's own alert box)."""
    said = f"{kind}\n{message}".encode()
    return hmac.new(token.encode(), b"flowloop flash\n" + said, hashlib.sha256).hexdigest()


def flash_shown(request: Request, kind: str) -> str:
    """The action's message of ``kind`` to show, when the URL carries it signed."""
    token = request.app.state.dash.token
    message = request.query_params.get(kind, "")
    given = request.query_params.get("sig", "")
    if not token or not message:
        return ""
    if not hmac.compare_digest(given.encode(), flash_sign(token, kind, message).encode()):
        return ""
    return message[:500]


def signed_in(request: Request) -> bool:
    dash = request.app.state.dash
    cookie = request.cookies.get(SESSION_COOKIE, "")
    return bool(dash.token) and hmac.compare_digest(cookie.encode(), dash.token.encode())


def _is_form(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in FORM_TYPES


async def _authorize(request: Request) -> dict[str, Any]:
    """The action's fields, once the token (and for a form, the CSRF field) checks out."""
    dash = request.app.state.dash
    token: str = dash.token or ""
    if _bearer(request):
        given = request.headers.get("authorization", "").partition(" ")[2]
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise Forbidden("the token is wrong (see the line `flowloop ui` printed at start-up)")
        return await _fields(request, api=True)
    if request.headers.get("authorization"):
        raise Forbidden("send the token as `Authorization: Bearer TOKEN`")
    # Refused before the body is read: a client without the token got the body's faults
    # (a 400 "not JSON") and had the whole of it read, whatever its size.
    if not signed_in(request):
        raise Forbidden("actions need the token: sign in at /login or send Authorization: Bearer")
    fields = await _fields(request)
    given_csrf = str(fields.get("csrf", ""))
    if not hmac.compare_digest(given_csrf.encode(), csrf_for(token).encode()):
        raise Forbidden("the form's CSRF field is missing or wrong; reload the page and retry")
    return fields


def _bearer(request: Request) -> bool:
    """An API client's request (``Authorization: Bearer …``): answered in JSON, never
    redirected to a page."""
    scheme = request.headers.get("authorization", "").partition(" ")[0]
    return scheme.lower() == "bearer"


def _form_reply(request: Request) -> bool:
    """A page's form: answered by a redirect back to the page, errors shown there."""
    return _is_form(request) and not _bearer(request)


async def _fields(request: Request, *, api: bool = False) -> dict[str, Any]:
    body = await request.body()
    # A JSON object sent as a form (`curl -d '{…}'` says x-www-form-urlencoded) is JSON.
    if _is_form(request) and not (api and body.lstrip().startswith(b"{")):
        form = await request.form()
        return {key: value for key, value in form.items() if isinstance(value, str)}
    if not body:
        return {}
    try:
        found = json.loads(body)
    except ValueError:
        raise BadInput("the body is not JSON (send a JSON object or a form)") from None
    if not isinstance(found, dict):
        raise BadInput("the body must be a JSON object")
    return found


def _refuse_unknown(fields: dict[str, Any], action: str, accepted: tuple[str, ...]) -> None:
    """A field the action does not take is refused, named: ``payload`` for ``data`` was
    ignored, and the error that followed (the event's data invalid) did not say why."""
    unknown = sorted(str(name) for name in fields if name not in accepted and name != "csrf")
    if not unknown:
        return
    named = ", ".join(repr(name[:40]) for name in unknown[:5])
    takes = f"accepted: {', '.join(accepted)}" if accepted else f"{action} takes none"
    raise BadInput(f"unknown field{'s' if len(unknown) > 1 else ''} {named} ({takes})")


def _who(request: Request) -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    client = request.client.host if request.client else "?"
    return f"ui:{user}@{client}"


def _text(fields: dict[str, Any], name: str, *, required: bool = False) -> str | None:
    value = fields.get(name)
    if value is None or value == "":
        if required:
            raise BadInput(f"{name} is required")
        return None
    if not isinstance(value, str) or len(value) > NAME_LIMIT:
        raise BadInput(f"{name} must be a text of at most {NAME_LIMIT} characters")
    if NUL in value:
        raise BadInput(f"{name} contains a NUL character")
    return value


def _payload(fields: dict[str, Any]) -> dict[str, Any] | None:
    data = fields.get("data")
    if data is None or data == "":
        return None
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as error:
            raise BadInput(f"data is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadInput("data must be a JSON object")
    return data


def _run_action(request: Request, run_id: str, action: str, fields: dict[str, Any]) -> RunInfo:
    engine = request.app.state.dash.engine
    if action == "pause":
        info: RunInfo = engine.pause(run_id)
    elif action == "unpause":
        info = engine.unpause(run_id)
    elif action == "stop":
        info = engine.stop(run_id)
    else:
        try:
            info = _defined_action(request, engine, run_id, action, fields)
        except UnknownWorkflow as error:  # as the CLI says "pass -w FILE_OR_DIR"
            raise FlowloopError(f"{error}: {NOT_LOADED}") from error
    return info


def _defined_action(
    request: Request, engine: Any, run_id: str, action: str, fields: dict[str, Any]
) -> RunInfo:
    """Retry or send: the actions that need the run's workflow definition."""
    if action == "retry":
        info: RunInfo = engine.retry(run_id, from_state=_text(fields, "from"), by=_who(request))
        return info
    event = _text(fields, "event", required=True)
    assert event is not None
    sent: RunInfo = engine.send(
        run_id, event, _payload(fields), dedupe_key=_text(fields, "dedupe_key")
    ).run
    return sent


def _named(request: Request, name: str) -> str:
    """The run id or loop name in the path (none holds a NUL: PostgreSQL refuses to look)."""
    value = str(request.path_params[name])[:NAME_LIMIT]
    if NUL in value:
        raise NotFound(f"no {'run' if name == 'run_id' else 'loop'} {value[:40]!r}")
    return value


def _back(request: Request, path: str, kind: str, message: str) -> RedirectResponse:
    """Back to the page, its message signed (:func:`flash_sign`)."""
    token = request.app.state.dash.token or ""
    query = {kind: message, "sig": flash_sign(token, kind, message)}
    return RedirectResponse(f"{path}?{urlencode(query)}", status_code=303)


async def run_action(request: Request) -> Response:
    run_id = _named(request, "run_id")
    action = str(request.path_params["action"])
    if action not in RUN_ACTIONS:
        raise NotFound(f"no action {action[:40]!r} (one of {', '.join(RUN_ACTIONS)})")
    form = _form_reply(request)
    fields = await _authorize(request)
    _refuse_unknown(fields, action, RUN_FIELDS.get(action, ()))
    try:
        info = await run_in_threadpool(_run_action, request, run_id, action, fields)
    except FlowloopError as error:
        if form and not isinstance(error, NotFound | UnknownRun):
            return _back(request, f"/runs/{segment(run_id)}", "error", str(error))
        raise
    if form:  # to the page of the whole id (the action may have been given a prefix)
        done = f"{action}: the run is {info.status} at {info.state}"
        return _back(request, f"/runs/{segment(info.id)}", "done", done)
    return JSONResponse(
        {"id": info.id, "status": info.status, "state": info.state, "last_seq": info.last_seq}
    )


def _loop_action(request: Request, name: str, action: str) -> LoopRow:
    engine = request.app.state.dash.engine
    method = {"pause": engine.pause_loop, "unpause": engine.unpause_loop, "stop": engine.stop_loop}
    row: LoopRow = method[action](name)
    return row


async def loop_action(request: Request) -> Response:
    name = _named(request, "name")
    action = str(request.path_params["action"])
    if action not in LOOP_ACTIONS:
        raise NotFound(f"no loop action {action[:40]!r} (one of {', '.join(LOOP_ACTIONS)})")
    form = _form_reply(request)
    _refuse_unknown(await _authorize(request), action, ())
    try:
        row = await run_in_threadpool(_loop_action, request, name, action)
    except FlowloopError as error:
        if form and not isinstance(error, NotFound | UnknownLoop):
            return _back(request, f"/loops/{name}", "error", str(error))
        raise
    if form:
        return _back(request, f"/loops/{name}", "done", f"{action}: the loop is {row.status}")
    return JSONResponse({"name": row.name, "status": row.status, "control": row.control})


async def login_form(request: Request) -> Response:
    templates = request.app.state.templates
    page: Response = templates.TemplateResponse(
        request, "login.html", {"signed_in": signed_in(request)}
    )
    return page


async def login(request: Request) -> Response:
    dash = request.app.state.dash
    form = await request.form()
    given = str(form.get("token", ""))
    if not hmac.compare_digest(given.encode(), (dash.token or "").encode()):
        templates = request.app.state.templates
        refused: Response = templates.TemplateResponse(
            request,
            "login.html",
            {"signed_in": False, "error": "that is not the token `flowloop ui` printed"},
            status_code=403,
        )
        return refused
    response = RedirectResponse("/runs", status_code=303)
    response.set_cookie(SESSION_COOKIE, given, httponly=True, samesite="strict", path="/")
    return response


def routes() -> list[Route]:
    return [
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/api/runs/{run_id:segment}/{action}", run_action, methods=["POST"]),
        Route("/api/loops/{name}/{action}", loop_action, methods=["POST"]),
    ]
