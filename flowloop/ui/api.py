"""The JSON API behind every page (described at ``/api/openapi.json``)."""

from __future__ import annotations

from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flowloop import family
from flowloop import journal as j
from flowloop.config import parse_duration
from flowloop.errors import FlowloopError
from flowloop.heat import heat
from flowloop.lifecycle import HELD, LIVE
from flowloop.ui import paths as _paths  # noqa: F401 (the {run_id:segment} converter)
from flowloop.ui import queries as q
from flowloop.ui.contextdiff import diff
from flowloop.ui.openapi import document

DEFAULT_WINDOW: Final = "24h"
MAX_SEQ: Final = 2**31 - 1
MAX_WINDOW: Final = 100 * 365 * 86400.0


def _dash(request: Request) -> Any:
    return request.app.state.dash


def _params(request: Request) -> dict[str, str]:
    return dict(request.query_params)


def path_text(request: Request, name: str) -> str:
    value = str(request.path_params[name])
    if len(value) > q.NAME_LIMIT:
        raise q.NotFound(f"no {name} {value[:40]}…")
    if q.NUL in value:  # none holds one (PostgreSQL refuses to look: it was a 503)
        raise q.NotFound(f"no {name} {value[:40]!r}")
    return value


def window(params: dict[str, str]) -> tuple[str, float | None]:
    """``since`` as (text, seconds; ``None`` for all history). Raises BadInput."""
    text = (params.get("since") or DEFAULT_WINDOW).strip()
    if text.lower() == "all":
        return "all", None
    try:
        seconds = parse_duration(text[:40])
    except (ValueError, FlowloopError):
        raise q.BadInput(f"since={text[:40]!r} is not a duration (30m, 24h, 7d) or 'all'") from None
    if not 0 < seconds <= MAX_WINDOW:
        raise q.BadInput(f"since must be a positive duration up to {MAX_WINDOW // 86400:.0f}d")
    return text, seconds


def since_epoch(request: Request, params: dict[str, str]) -> tuple[str, float | None]:
    text, seconds = window(params)
    if seconds is None:
        return text, None
    return text, _dash(request).store.db_now() - seconds


# -- runs ----------------------------------------------------------------------------------


def runs_json(request: Request) -> Response:
    query = q.RunsQuery.parse(_params(request))
    page = q.list_runs(_dash(request).db, query)
    return JSONResponse(
        {"runs": page.runs, "next": page.next_cursor, "counts": page.counts},
    )


def run_json(request: Request) -> Response:
    return JSONResponse(run_facts(_dash(request), path_text(request, "run_id")))


def run_facts(dash: Any, run_id: str) -> dict[str, Any]:
    """The run row as the API and the run page give it, with ``held``: a map's child held
    back by its parent's ``max_parallel`` (as `flowloop status --json` says)."""
    row = q.run_row(dash.db, run_id)
    row["held"] = family.held_back(dash.store, row["id"], live=row["status"] in LIVE)
    if row["held"]:  # shown as its parent's children list and counts show it
        row["display_status"] = family.child_status(row["status"], HELD)
    return row


def progress_json(request: Request) -> Response:
    return JSONResponse(q.run_progress(_dash(request).db, path_text(request, "run_id")))


def journal_json(request: Request) -> Response:
    run_id = path_text(request, "run_id")
    params = _params(request)
    after = q.int_param(params, "after", 0, high=MAX_SEQ)
    limit = q.int_param(params, "limit", q.MAX_JOURNAL, low=1, high=q.MAX_JOURNAL)
    events = q.run_journal(_dash(request).store, run_id)
    entries = q.journal_page(run_id, events, after=after, limit=limit)
    last = entries[-1]["seq"] if entries else after
    return JSONResponse(
        {
            "run_id": run_id,
            # Each context only where it changed, within a bound: q.journal_page.
            "events": entries,
            # The timeline of this page's entries only (paired over the whole journal): it
            # was the whole run's whatever the limit (1.2 MB for limit=10 at 10,000 entries).
            "timeline": [t for t in q.timeline(events) if after < t["seq"] <= last],
        }
    )


def seq_param(params: dict[str, str], name: str, default: int) -> int:
    return q.int_param(params, name, default, low=1, high=MAX_SEQ)


def context_json(request: Request) -> Response:
    run_id = path_text(request, "run_id")
    events = q.run_journal(_dash(request).store, run_id)
    seq = seq_param(_params(request), "seq", len(events))
    return JSONResponse({"run_id": run_id, "seq": seq, "context": q.context_at(events, seq)})


def diff_json(request: Request) -> Response:
    run_id = path_text(request, "run_id")
    events = q.run_journal(_dash(request).store, run_id)
    params = _params(request)
    to = seq_param(params, "to", len(events))
    start = seq_param(params, "from", 1)
    before, after = q.context_at(events, start), q.context_at(events, to)
    return JSONResponse(
        {
            "run_id": run_id,
            "from": start,
            "to": to,
            "changes": [d.as_dict() for d in diff(before, after)],
        }
    )


def run_svg(request: Request) -> Response:
    dash = _dash(request)
    run_id = path_text(request, "run_id")
    return Response(run_diagram(dash, run_id), media_type="image/svg+xml")


def run_diagram(dash: Any, run_id: str, events: list[j.JournalEvent] | None = None) -> str:
    """The run drawn on its workflow, as inline SVG (NotFound when its machine is unknown)."""
    row = q.run_row(dash.db, run_id)
    events = events if events is not None else q.run_journal(dash.store, run_id)
    held = row["display_status"] == HELD  # (its row's join_state: q.run_row)
    graph = dash.machines.run_graph(
        row["workflow"], row["fingerprint"], row["version"], events, held=held
    )
    if graph is None:
        raise q.NotFound(
            f"workflow {row['workflow']} is neither given with -w nor stored; cannot draw it"
        )
    svg: str = dash.svgs.svg(graph)
    return svg


# -- workflows -----------------------------------------------------------------------------


def workflow_names(dash: Any) -> list[str]:
    seen = set(q.definitions_seen(dash.db)) | set(dash.workflows)
    return sorted(seen)


def workflows_json(request: Request) -> Response:
    dash = _dash(request)
    seen = q.definitions_seen(dash.db)
    counts = q.status_counts(dash.db)
    names = sorted(set(seen) | set(dash.workflows) | set(counts))
    return JSONResponse(
        {
            "workflows": [
                {
                    "name": name,
                    "loaded": name in dash.workflows,
                    "versions": [
                        {k: v for k, v in d.items() if k != "structure"} for d in seen.get(name, [])
                    ],
                    "counts": counts.get(name, {}),
                }
                for name in names
            ]
        }
    )


def workflow_overview(request: Request, name: str) -> dict[str, Any]:
    """Stats and heat of one workflow over the ``since`` window (NotFound when unknown)."""
    dash = _dash(request)
    params = _params(request)
    seen = q.definitions_seen(dash.db).get(name, [])
    if not seen and name not in dash.workflows:
        raise q.NotFound(f"no workflow {name[:80]}")
    text, since = since_epoch(request, params)
    now = dash.store.db_now()
    counts = q.status_counts(dash.db).get(name, {})
    found = heat(dash.db, name, since=since)
    finished = counts.get("succeeded", 0) + counts.get("failed", 0) + counts.get("stopped", 0)
    return {
        "name": name,
        "since": text,
        "since_epoch": since,
        "versions": [{k: v for k, v in d.items() if k != "structure"} for d in seen],
        "counts": counts,
        "runs": sum(counts.values()),
        "success_rate": (counts.get("succeeded", 0) / finished) if finished else None,
        "states": [s.as_dict() for s in found.stats],
        "whole_runs": q.run_summary(dash.db, name, since=since, now=now),
        "heat": found,
    }


def workflow_json(request: Request) -> Response:
    found = workflow_overview(request, path_text(request, "name"))
    found["heat"] = found["heat"].as_dict()
    return JSONResponse(found)


def heat_svg(request: Request) -> Response:
    dash = _dash(request)
    name = path_text(request, "name")
    found = workflow_overview(request, name)
    return Response(heat_diagram(dash, name, found), media_type="image/svg+xml")


def heat_diagram(dash: Any, name: str, found: dict[str, Any]) -> str:
    newest = found["versions"][0] if found["versions"] else {}
    graph = dash.machines.heat_graph(
        name,
        newest.get("fingerprint"),
        int(newest.get("version", 0)),
        found["heat"],
        "" if found["since"] == "all" else found["since"],
    )
    if graph is None:
        raise q.NotFound(f"workflow {name[:80]} has no stored definition to draw")
    svg: str = dash.svgs.svg(graph)
    return svg


# -- loops and workers ---------------------------------------------------------------------


def loops_json(request: Request) -> Response:
    return JSONResponse({"loops": q.loop_rows(_dash(request).db)})


def loop_json(request: Request) -> Response:
    dash = _dash(request)
    name = path_text(request, "name")
    params = _params(request)
    limit = q.int_param(params, "limit", q.LOOP_EVENTS, low=1, high=1000)
    return JSONResponse(
        {
            "loop": q.loop_row(dash.db, name),
            "events": q.loop_events(dash.db, name, limit=limit),
            "counts": q.loop_kind_counts(dash.db, name),
        }
    )


def workers_json(request: Request) -> Response:
    dash = _dash(request)
    return JSONResponse(q.workers(dash.db, dash.store.db_now()))


def openapi_json(request: Request) -> Response:
    return JSONResponse(document(actions=_dash(request).allow_actions))


def routes() -> list[Route]:
    return [
        Route("/api/openapi.json", openapi_json),
        Route("/api/runs", runs_json),
        Route("/api/runs/{run_id:segment}", run_json),
        Route("/api/runs/{run_id:segment}/progress", progress_json),
        Route("/api/runs/{run_id:segment}/journal", journal_json),
        Route("/api/runs/{run_id:segment}/context", context_json),
        Route("/api/runs/{run_id:segment}/diff", diff_json),
        Route("/api/runs/{run_id:segment}/diagram.svg", run_svg),
        Route("/api/workflows", workflows_json),
        # :path, so a name with a slash (a stored one; definitions refuse it) still routes.
        Route("/api/workflows/{name:path}/heat.svg", heat_svg),
        Route("/api/workflows/{name:path}", workflow_json),
        Route("/api/loops", loops_json),
        Route("/api/loops/{name:path}", loop_json),
        Route("/api/workers", workers_json),
    ]
