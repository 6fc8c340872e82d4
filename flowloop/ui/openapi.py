"""The OpenAPI 3.1 document of the dashboard's JSON API (served at ``/api/openapi.json``)."""

from __future__ import annotations

from typing import Any, Final

from flowloop.ui.waiting import SHOWN_STATUSES

ERROR: Final = {
    "type": "object",
    "required": ["error", "status"],
    "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
}
OBJECT: Final = {"type": "object"}


def _param(name: str, where: str = "query", schema: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "schema": schema or {"type": "string"},
        **extra,
    }


RUN_ID: Final = _param(
    "run_id",
    "path",
    description="A run id, percent-encoded as one path segment (`/` as `%2F`)",
)
NAME: Final = _param("name", "path")
SEQ: Final = {"type": "integer", "minimum": 1}


def _responses(ok: str, *errors: int, media: str = "application/json") -> dict[str, Any]:
    found: dict[str, Any] = {
        "200": {
            "description": ok,
            "content": {
                media: {"schema": OBJECT if media != "image/svg+xml" else {"type": "string"}}
            },
        }
    }
    for code in errors:
        found[str(code)] = {
            "description": {400: "malformed parameter", 404: "not found", 403: "refused"}.get(
                code, "refused"
            ),
            "content": {"application/json": {"schema": ERROR}},
        }
    return found


def _get(
    summary: str, params: list[dict[str, Any]], *errors: int, media: str = "application/json"
) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": params,
            "responses": _responses(summary, *errors, media=media),
        }
    }


RUN_ACTION_BODY: Final = {
    "required": False,
    "description": "send: event (required), data, dedupe_key; retry: from (a past state); "
    "pause, unpause, stop: none. Any other field is refused (400); retry and send need the "
    "run's workflow loaded (flowloop ui -w)",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "event": {"type": "string"},
                    "data": {"type": "object"},
                    "dedupe_key": {"type": "string"},
                    "from": {"type": "string"},
                },
                "additionalProperties": False,
            }
        }
    },
}


def document(*, actions: bool = False) -> dict[str, Any]:
    """The API as OpenAPI 3.1 (with the action endpoints when they are enabled)."""
    window = _param("since", description="A duration (30m, 24h, 7d) or 'all'; default 24h")
    paths: dict[str, Any] = {
        "/api/runs": _get(
            "Runs, newest first, keyset-paged, with counts per status",
            [
                _param("workflow"),
                _param("status", schema={"type": "string", "enum": list(SHOWN_STATUSES)}),
                _param("key"),
                _param("id", description="A run id prefix"),
                _param("after", description="The cursor `next` of the previous page"),
                _param("limit", schema={"type": "integer", "minimum": 1, "maximum": 500}),
            ],
            400,
        ),
        "/api/runs/{run_id}": _get("One run's row", [RUN_ID], 404),
        "/api/runs/{run_id}/progress": _get(
            "last_seq, status and state (cheap, for polling)", [RUN_ID], 404
        ),
        "/api/runs/{run_id}/journal": _get(
            "The journal (entries after `after`, at most `limit`) and the timeline of their"
            " steps. An entry that wrote a context holds it only where it changed"
            " (`context_status`: `shown`, `unchanged` or `cut`, null for an entry that wrote"
            " none), within 2,000,000 characters of context a page; `context_url` gives it"
            " whole (`/api/runs/{run_id}/context?seq=N`)",
            [
                RUN_ID,
                _param("after", schema={"type": "integer", "minimum": 0}),
                _param("limit", schema={"type": "integer", "minimum": 1, "maximum": 5000}),
            ],
            400,
            404,
        ),
        "/api/runs/{run_id}/context": _get(
            "The context at a seq", [RUN_ID, _param("seq", schema=SEQ)], 400, 404
        ),
        "/api/runs/{run_id}/diff": _get(
            "The context difference between two seqs",
            [RUN_ID, _param("from", schema=SEQ), _param("to", schema=SEQ)],
            400,
            404,
        ),
        "/api/runs/{run_id}/diagram.svg": _get(
            "The run drawn on its workflow", [RUN_ID], 404, media="image/svg+xml"
        ),
        "/api/workflows": _get("Workflows: versions seen and runs per status", []),
        "/api/workflows/{name}": _get(
            "Stats and heat of one workflow over a window", [NAME, window], 400, 404
        ),
        "/api/workflows/{name}/heat.svg": _get(
            "All runs of a window drawn on the machine",
            [NAME, window],
            400,
            404,
            media="image/svg+xml",
        ),
        "/api/loops": _get("Every loop", []),
        "/api/loops/{name}": _get(
            "One loop with its newest journal entries",
            [NAME, _param("limit", schema={"type": "integer", "minimum": 1, "maximum": 1000})],
            400,
            404,
        ),
        "/api/workers": _get("Leases per owner and the queue", []),
    }
    if actions:
        for path, what, names, body in (
            (
                "/api/runs/{run_id}/{action}",
                "pause, unpause, stop, retry or send to a run",
                ["pause", "unpause", "stop", "retry", "send"],
                RUN_ACTION_BODY,
            ),
            (
                "/api/loops/{name}/{action}",
                "pause, unpause or stop a loop",
                ["pause", "unpause", "stop"],
                None,
            ),
        ):
            key = RUN_ID if "run_id" in path else NAME
            action = _param("action", "path", schema={"type": "string", "enum": names})
            paths[path] = {
                "post": {
                    "summary": what,
                    "parameters": [key, action],
                    "security": [{"token": []}],
                    **({"requestBody": body} if body else {}),
                    "responses": _responses("the run or loop after the action", 400, 403, 404),
                }
            }
    return {
        "openapi": "3.1.0",
        "info": {"title": "flowloop dashboard API", "version": "1"},
        "paths": paths,
        "components": {
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
        },
    }
