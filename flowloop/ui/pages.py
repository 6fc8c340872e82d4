"""The HTML pages: runs, one run (live), workflows, loops, workers.

Each page is rendered on the server from the same queries as the JSON API; the only script
(``static/app.js``) keeps a run page live by polling ``/api/runs/{id}/progress`` and, when
``last_seq`` moves, swapping in ``/runs/{id}/live`` (header, diagram, timeline).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from flowloop import dues, family, render_loops
from flowloop.definition import Workflow
from flowloop.errors import RenderError
from flowloop.journal import ASLEEP
from flowloop.lifecycle import FINISHED
from flowloop.operations import retryable_from
from flowloop.ui import api
from flowloop.ui import queries as q
from flowloop.ui.actions import NOT_LOADED, csrf_for, flash_shown, signed_in
from flowloop.ui.contextdiff import diff
from flowloop.ui.waiting import SHOWN_STATUSES, WAITING

WINDOWS: Final = ("1h", "24h", "7d", "30d", "all")
ITERATION_KINDS: Final = ("iteration_succeeded", "iteration_failed", "iteration_interrupted")
DECISION_KINDS: Final = ("missed", "coalesced", "skipped_overlap")
TIMELINE_SHOWN: Final = 500
"""Timeline rows a run page shows at most (the newest; the JSON journal pages the rest):
a run of 10,000 entries made a 2.5 MB page, fetched again at each of its commits."""
ERRORS_SHOWN: Final = 20
CONTEXT_SHOWN: Final = 100_000
"""Characters of a context a run page shows (the JSON context API gives it whole)."""
CHANGES_SHOWN: Final = 200
VALUE_SHOWN: Final = 2_000
"""Characters of one value (a changed path's before or after, an error) a page shows."""


def _render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    templates = request.app.state.templates
    dash = request.app.state.dash
    base = {
        "nav": name.split(".")[0].split("_")[0],
        "signed_in": dash.allow_actions and signed_in(request),
        "csrf": csrf_for(dash.token) if dash.token else "",
        "flash_error": flash_shown(request, "error"),
        "flash_done": flash_shown(request, "done"),
    }
    response: Response = templates.TemplateResponse(
        request, name, {**base, **context}, status_code=status
    )
    return response


def home(request: Request) -> Response:
    # The query goes along: a link or bookmark of /?status=failed lands on those runs.
    query = request.url.query
    return RedirectResponse(f"/runs?{query}" if query else "/runs", status_code=307)


def runs_page(request: Request) -> Response:
    dash = request.app.state.dash
    query = q.RunsQuery.parse(dict(request.query_params))
    page = q.list_runs(dash.db, query)
    filters = query.filters()
    next_link = (
        "/runs?" + urlencode({**filters, "after": page.next_cursor}) if page.next_cursor else None
    )
    status_links = {
        status: "/runs?"
        + urlencode({**{k: v for k, v in filters.items() if k != "status"}, "status": status})
        for status in SHOWN_STATUSES
    }
    return _render(
        request,
        "runs.html",
        {
            "page": page,
            "query": query,
            "filters": filters,
            "statuses": SHOWN_STATUSES,
            "status_links": status_links,
            "all_link": "/runs?" + urlencode({k: v for k, v in filters.items() if k != "status"}),
            "next_link": next_link,
            "paged": query.after is not None,
            "workflows": api.workflow_names(dash),
        },
    )


def json_text(value: Any, *, indent: int | None = None) -> str:
    """A value as JSON to show as text (the page escapes it): letters of every script as
    they are, not ``\\u`` escapes (Jinja's ``tojson`` escapes ``<``, ``&`` and ``'`` too,
    for a script's data, not for text)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=True)


def cut(text: Any, limit: int = VALUE_SHOWN, where: str = "") -> str:
    """``text`` up to ``limit`` characters, saying how long it is when it is cut (a page
    stays bounded whatever a run holds: a 1 MB context or error message)."""
    whole = "" if text is None else str(text)
    if len(whole) <= limit:
        return whole
    more = f"; {where}" if where else ""
    return f"{whole[:limit]}… (cut: {len(whole):,} characters in all{more})"


def cut_head(text: Any, limit: int = VALUE_SHOWN) -> str:
    """``text``'s last ``limit`` characters, saying how long it is when it is cut: what a
    traceback says last (the innermost frames, the error, the last of a chain) is what
    failed."""
    whole = "" if text is None else str(text)
    if len(whole) <= limit:
        return whole
    return f"(cut: {len(whole):,} characters in all; the end follows) …{whole[-limit:]}"


def retry_states(workflow: Workflow) -> list[str]:
    """The states a retry may start a run of ``workflow`` from, in declaration order."""
    return [state for state in workflow.states if retryable_from(workflow, state)]


def fmt_time(value: float | None) -> str:
    """A time as the dashboard writes it (UTC, to the second; a dash for none)."""
    if value is None:
        return "\u2013"
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")


def next_move(run: Mapping[str, Any], due: dues.Due | None = None) -> str | None:
    """What a run does when its ``next_run_at`` comes, for its page's "Next run" (``""``:
    it goes on at its state). None when the page shows no such time there: the run is not
    scheduled or retrying, has no time, is held back (its turn has none), or waits (its
    "Waits for" says until when). ``due``: when its deadline comes first (that time is
    the deadline's: flowloop/dues.py), the run moves to its ``on_deadline`` state then."""
    if run["next_run_at"] is None or run["held"] or run["display_status"] == WAITING:
        return None
    if run["status"] == "retrying":
        own = f"attempt {int(run['attempt']) + 1} of {run['state']}"
    elif run["status"] == "scheduled":
        own = "it wakes from its step.sleep" if run["reason"] == ASLEEP else ""
    else:
        return None
    if due is not None and due.deadline_first:
        if not own and due.own is not None:  # a sleep before its state (a compensating one)
            own = f"it goes on at {run['state']} at {fmt_time(due.own)} UTC"
        return due.deadline_words() + (f", before {own}" if own else "")
    return own.removeprefix("it ")


def _run_view(request: Request, run_id: str) -> dict[str, Any]:
    """Everything the live part of a run page shows (header, diagram, timeline, errors,
    context at ``?seq=`` and the changes ``?from=&to=``, by default the latest)."""
    dash = request.app.state.dash
    row = api.run_facts(dash, run_id)
    events = q.run_journal(dash.store, run_id)
    params = dict(request.query_params)
    last = len(events)
    seq = api.seq_param(params, "seq", last)
    start = api.seq_param(params, "from", max(1, last - 1))
    to = api.seq_param(params, "to", last)
    context = q.context_at(events, seq)
    changes = diff(q.context_at(events, start), q.context_at(events, to))
    workflow = dash.workflows.get(row["workflow"])
    try:
        svg = api.run_diagram(dash, run_id, events)
        problem = None
    except (q.NotFound, RenderError) as error:
        svg, problem = None, str(error)
    except (KeyError, TypeError, ValueError) as error:  # a journal written badly elsewhere
        svg, problem = None, f"cannot draw this run from its journal: {error!r}"
    every_step = q.timeline(events)
    steps = every_step[-TIMELINE_SHOWN:]
    longest = max((s.get("duration") or 0.0 for s in steps), default=0.0)
    every_failure = [e for e in events if e.traceback or e.error_message]
    failures = every_failure[-ERRORS_SHOWN:]
    context_text = json_text(context, indent=2)
    live = row["status"] not in FINISHED
    due = dues.due(
        status=row["status"],
        state=row["state"],
        next_run_at=row["next_run_at"],
        events=events,
        structure=lambda: dash.store.definition(row["fingerprint"]),
    )
    return {
        "run": row,
        "held_back": family.HELD_BACK if row["held"] else None,
        "next_move": next_move(row, due),
        "due": due,
        # What the run itself waits for (a sleep's end, a retry's attempt), its deadline
        # aside: its next_run_at may be the deadline's.
        "own_at": due.own_at if due is not None and due.own_at is not None else row["next_run_at"],
        # The database's clock (as the workers page's): "in 59 min" from it.
        "now": dash.store.db_now() if live and row["next_run_at"] is not None else None,
        "events": events,
        "steps": steps,
        "steps_hidden": len(every_step) - len(steps),
        "longest": longest or 1.0,
        "svg": svg,
        "diagram_problem": problem,
        "failures": failures,
        "failures_hidden": len(every_failure) - len(failures),
        "live": live,
        "seq": seq,
        "diff_from": start,
        "diff_to": to,
        "context_text": cut(context_text, CONTEXT_SHOWN, "the whole at the link below"),
        "context_cut": len(context_text) > CONTEXT_SHOWN,
        "changes": changes[:CHANGES_SHOWN],
        "changes_hidden": max(0, len(changes) - CHANGES_SHOWN),
        "retry_states": retry_states(workflow) if workflow is not None else [],
        # Retry and send need the definition: without it their forms are disabled, saying why.
        "not_loaded": None
        if workflow is not None
        else f"workflow {row['workflow']!r} is not loaded: {NOT_LOADED}",
        "family": q.run_family(dash.store, run_id),
    }


def run_page(request: Request) -> Response:
    """A run's page (a unique id prefix, as the CLI takes and `status` prints on narrow
    terminals, redirects to the page of the whole id: flowloop/ui/app.py)."""
    run_id = api.path_text(request, "run_id")
    return _render(request, "run.html", _run_view(request, run_id))


def run_live(request: Request) -> Response:
    """The parts of a run page that change while it moves (swapped in by app.js)."""
    run_id = api.path_text(request, "run_id")
    return _render(request, "run_live.html", _run_view(request, run_id))


def workflows_page(request: Request) -> Response:
    dash = request.app.state.dash
    seen = q.definitions_seen(dash.db)
    counts = q.status_counts(dash.db)
    names = sorted(set(seen) | set(dash.workflows) | set(counts))
    cards = []
    for name in names:
        found = counts.get(name, {})
        finished = sum(found.get(s, 0) for s in ("succeeded", "failed", "stopped"))
        cards.append(
            {
                "name": name,
                "loaded": name in dash.workflows,
                "versions": seen.get(name, []),
                "counts": found,
                "runs": sum(found.values()),
                "success_rate": found.get("succeeded", 0) / finished if finished else None,
                "parts": [(s, found[s]) for s in SHOWN_STATUSES if found.get(s)],
            }
        )
    return _render(request, "workflows.html", {"cards": cards, "statuses": SHOWN_STATUSES})


def workflow_page(request: Request) -> Response:
    dash = request.app.state.dash
    name = api.path_text(request, "name")
    found = api.workflow_overview(request, name)
    newest = found["versions"][0] if found["versions"] else {}
    chosen = newest
    wanted = request.query_params.get("fingerprint")
    if wanted:
        chosen = next((v for v in found["versions"] if v["fingerprint"] == wanted), {})
        if not chosen:
            raise q.NotFound(f"workflow {name[:80]} has no stored version {wanted[:40]}")
    plain = dash.machines.definition_graph(
        name, chosen.get("fingerprint"), int(chosen.get("version", 0))
    )
    problem = None
    try:
        plain_svg = dash.svgs.svg(plain) if plain is not None else None
        heat_svg = api.heat_diagram(dash, name, found) if plain is not None else None
    except RenderError as error:  # no `dot`: the numbers still show
        plain_svg = heat_svg = None
        problem = str(error)
    slowest = max((s["p99"] or 0.0 for s in found["states"]), default=0.0)
    return _render(
        request,
        "workflow.html",
        {
            "wf": found,
            "plain_svg": plain_svg,
            "heat_svg": heat_svg,
            "diagram_problem": problem,
            "shown": chosen,
            "windows": WINDOWS,
            "slowest": slowest or 1.0,
            "statuses": SHOWN_STATUSES,
        },
    )


def loops_page(request: Request) -> Response:
    dash = request.app.state.dash
    return _render(request, "loops.html", {"loops": q.loop_rows(dash.db)})


def loop_page(request: Request) -> Response:
    dash = request.app.state.dash
    name = api.path_text(request, "name")
    row = q.loop_row(dash.db, name)
    events = q.loop_events(dash.db, name, limit=200)
    counts = q.loop_kind_counts(dash.db, name)
    iterations = [e for e in events if e["kind"] in ITERATION_KINDS][:25]
    decisions = [e for e in events if e["kind"] in DECISION_KINDS][:25]
    # The loop's machine with what it did drawn on it, as `flowloop diagram --loop` draws
    # it (every transition a loop can take when its definition is not loaded).
    stored = dash.store.get_loop(name)
    limit = render_loops.OVERLAY_JOURNAL_LIMIT
    journal = dash.store.loop_journal(name, limit=limit) if stored is not None else []
    loop = dash.loops.get(name)
    machine = (
        None
        if stored is None  # deleted since its row was read
        else render_loops.stored_loop_digraph(
            loop,
            stored,
            journal,
            capped=len(journal) >= limit,
            # Its workflow's page (the CLI's `<workflow>.svg` beside it was /loops/x.svg: a 404).
            workflow_diagram=(
                f"/workflows/{quote(loop.workflow.name, safe='')}"
                if loop is not None and loop.workflow is not None
                else None
            ),
        )
    )
    return _render(
        request,
        "loop.html",
        {
            "loop": row,
            "iterations": iterations,
            "decisions": decisions,
            "counts": counts,
            "svg": dash.svgs.svg(machine) if machine is not None else "",
            "defined": loop is not None,
        },
    )


def workers_page(request: Request) -> Response:
    dash = request.app.state.dash
    return _render(request, "workers.html", {"w": q.workers(dash.db, dash.store.db_now())})


def routes() -> list[Route]:
    return [
        Route("/", home),
        Route("/runs", runs_page),
        Route("/runs/{run_id:segment}", run_page),
        Route("/runs/{run_id:segment}/live", run_live),
        Route("/workflows", workflows_page),
        Route("/workflows/{name:path}", workflow_page),
        Route("/loops", loops_page),
        Route("/loops/{name:path}", loop_page),
        Route("/workers", workers_page),
    ]
