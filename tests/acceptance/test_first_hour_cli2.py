"""The first hour of a new user at the command line, second audit: what the first one
(test_first_hour_cli.py) noticed and left alone. Each mistake is one line on stderr, no
traceback, exit 2; what worked before prints what it printed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import textwrap
from pathlib import Path
from unittest import mock

import click
import pytest
from test_first_hour_cli import as_json, clean_env, quick, refused
from test_first_hour_cli import flowloop as a_process

import flowloop.cli
from flowloop.cli import main

FLOW = """
    from pydantic import BaseModel, ConfigDict

    from flowloop import Workflow


    class Order(BaseModel):
        order_id: str
        note: str | None = None


    class Approval(BaseModel):
        by: str
        note: str | None = None


    class Rejection(BaseModel):
        model_config = ConfigDict(extra="allow")
        by: str


    order_flow = Workflow("order", context=Order, key="order_id")


    @order_flow.step(initial=True, next="awaiting")
    def reserve(ctx: Order) -> None: ...


    order_flow.wait(
        "awaiting",
        on={"approve": "shipped", "reject": "cancelled"},
        payloads={"approve": Approval, "reject": Rejection},
        handlers={"approve": lambda ctx, a: setattr(ctx, "note", a.note)},
    )
    order_flow.final("shipped", "cancelled")
"""

CONTEXT = '{"order_id": "A1"}'

INVOICES = """
    from pydantic import BaseModel

    from flowloop import Workflow


    class Invoice(BaseModel):
        number: str


    invoice_flow = Workflow("invoice", context=Invoice)


    @invoice_flow.step(initial=True, next="sent")
    def send(ctx: Invoice) -> None: ...


    invoice_flow.final("sent")
"""


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A project as `flowloop` finds one: its workflow in ./workflows."""
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "orders.py").write_text(textwrap.dedent(FLOW).lstrip())
    return tmp_path


def started(here: Path, db: str, order_id: str) -> str:
    context = f'{{"order_id": "{order_id}"}}'
    shown = as_json("run", "workflows/orders.py", "--context", context, "--db", db, cwd=here)
    assert shown["run"]["state"] == "awaiting"
    return str(shown["run"]["id"])


# -- 1: status --workflow with a misspelt name ---------------------------------------------

IMPORTED = """
    from pathlib import Path

    Path("imported").write_text("yes")
    raise SystemExit(3)
"""


def test_status__a_misspelt_workflow_lists_nothing_and_hints_on_stderr(
    here: Path, store_url: str
) -> None:
    """Before: `no runs with workflow 'ordr'`, exit 0, as for a workflow that is quiet,
    and no word of the name. It stays a valid empty listing (a script polling a workflow
    before its first run must keep working), with the close names on stderr."""
    started(here, store_url, "A1")
    shown = a_process("status", "--workflow", "ordr", "--db", store_url, cwd=here)
    assert shown.stdout == "no runs with workflow 'ordr'\n"
    assert shown.stderr == "no workflow 'ordr' in this database; did you mean 'order'?\n"
    shown = a_process("status", "--workflow", "zzz", "--json", "--db", store_url, cwd=here)
    assert json.loads(shown.stdout)["runs"] == []
    assert shown.stderr == "no workflow 'zzz' in this database (known: order)\n"
    # A workflow that is there, with no run that matches: as before, nothing on stderr.
    shown = a_process(
        "status", "--workflow", "order", "--status", "failed", "--db", store_url, cwd=here
    )
    assert (shown.stdout, shown.stderr) == ("no runs with workflow 'order', status failed\n", "")
    assert as_json("status", "--workflow", "order", "--db", store_url, cwd=here)["runs"]


def test_status__a_workflow_before_its_first_run_is_an_empty_listing(
    here: Path, store_url: str
) -> None:
    """Before: exit 2 `no workflow 'invoice' in this database` for a workflow defined in
    code (not in ./workflows: status has no -w) that has not run yet, and for every
    workflow when one file in ./workflows did not import; ./workflows' files were imported
    (user code run by status: a file calling sys.exit ended it)."""
    started(here, store_url, "A1")
    (here / "workflows" / "broken.py").write_text(textwrap.dedent(IMPORTED).lstrip())
    args = ("status", "--workflow", "invoice", "--db", store_url)
    shown = a_process(*args, "--json", cwd=here)
    page = json.loads(shown.stdout)
    assert (page["runs"], page["truncated"], page["next_after"]) == ([], False, None)
    assert shown.stderr == "no workflow 'invoice' in this database (known: order)\n"
    assert a_process(*args, cwd=here).stdout == "no runs with workflow 'invoice'\n"
    assert not (here / "imported").exists()
    # Its first run: listed, and no hint.
    (here / "invoices.py").write_text(textwrap.dedent(INVOICES).lstrip())
    as_json("run", "invoices.py", "--context", '{"number": "7"}', "--db", store_url, cwd=here)
    shown = a_process(*args, "--json", cwd=here)
    assert [run["workflow"] for run in json.loads(shown.stdout)["runs"]] == ["invoice"]
    assert shown.stderr == ""
    assert not (here / "imported").exists()


# -- 2: run with a misspelt workflow name --------------------------------------------------


def test_run__a_misspelt_workflow_name_names_the_target_meant(here: Path) -> None:
    """Before: `error: ordr: no such file`, and no more."""
    line = refused("run", "ordr", "--context", '{"order_id": "A1"}', cwd=here)
    assert line == "error: ordr: no such file; did you mean workflows/orders.py:order?"
    # The workflow's name itself is no file either: the target that runs it.
    line = quick("start", "order", "--context", '{"order_id": "A1"}', cwd=here)
    assert line == "error: order: no such file; did you mean workflows/orders.py:order?"
    # A misspelt file in ./workflows.
    line = quick("run", "ordrs.py", cwd=here)
    assert line == "error: ordrs.py: no such file; did you mean workflows/orders.py?"
    assert quick("run", "nothing_like_it", cwd=here) == "error: nothing_like_it: no such file"
    assert not (here / "flowloop.db").exists()


UNRULY = {  # ./workflows files a hint must not run (imported in this order before)
    "a_prints.py": "print('hello from a_prints')\n",
    "b_thread.py": "import threading\n\nthreading.Thread(target=threading.Event().wait).start()\n",
    "c_exits.py": "import sys\n\nsys.exit(3)\n",
    "d_broken.py": "def (:\n",
    "e_invoices.py": textwrap.dedent(INVOICES)
    .lstrip()
    .replace("from flowloop import Workflow", "import flowloop")
    .replace(
        'Workflow("invoice", context=Invoice)', 'flowloop.Workflow(name="invoice", context=Invoice)'
    ),
}


def test_run__a_misspelt_workflow_name_runs_no_file_of_workflows(here: Path) -> None:
    """Before: the files of ./workflows were imported to find the name meant: a file's
    print went into the output, a thread it started hung the process, its sys.exit(3)
    ended it (exit 3, the real error never said). Now they are read, not run."""
    for name, text in UNRULY.items():
        (here / "workflows" / name).write_text(text)
    shown = a_process("run", "ordr", "--context", CONTEXT, cwd=here, code=2)
    assert shown.stdout == ""
    assert shown.stderr == "error: ordr: no such file; did you mean workflows/orders.py:order?\n"
    shown = a_process("start", "invoce", cwd=here, code=2)
    assert (shown.stdout, shown.stderr) == (
        "",
        "error: invoce: no such file; did you mean workflows/e_invoices.py:invoice?\n",
    )


# -- 3: send --data with a misspelt optional field -----------------------------------------


def test_send__a_payload_field_the_model_has_not_is_refused_not_dropped(
    here: Path, store_url: str
) -> None:
    """Before: `approve: applied`, the note dropped without a word (pydantic ignores
    extra keys) and the run gone on without it."""
    run_id = started(here, store_url, "A1")
    data = '{"by": "ann", "nte": "rush"}'
    line = refused("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert line == (
        "error: --data: no field 'nte' in Approval, the payload of 'approve'; "
        "did you mean 'note'? (fields: by, note)"
    )
    line = quick("send", run_id, "approve", "--buffer", "--data", data, "--db", store_url, cwd=here)
    assert line.startswith("error: --data: no field 'nte' in Approval")
    shown = as_json("status", run_id, "--db", store_url, cwd=here)
    assert (shown["display_status"], shown["state"]) == ("waiting", "awaiting")  # not applied
    # The field as the model spells it: applied, and kept.
    data = '{"by": "ann", "note": "rush"}'
    sent = as_json("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert sent["result"] == "applied"
    assert sent["run"]["status"] == "succeeded"
    assert sent["run"]["context"]["note"] == "rush"
    # A model that takes extra keys (extra="allow") takes them as before.
    other = started(here, store_url, "A2")
    data = '{"by": "bob", "why": "late"}'
    sent = as_json("send", other, "reject", "--data", data, "--db", store_url, cwd=here)
    assert (sent["result"], sent["run"]["state"]) == ("applied", "cancelled")


TICKETS = """
    from pydantic import BaseModel, ConfigDict, Field

    from flowloop import Workflow


    class Ticket(BaseModel):
        ticket_id: str
        note: str | None = None


    class Approval(BaseModel):  # validated by alias only, as pydantic does by default
        by: str
        note: str | None = Field(None, alias="comment")


    class Remark(BaseModel):  # by alias and by name
        model_config = ConfigDict(populate_by_name=True)
        note: str | None = Field(None, alias="comment")


    def noted(ctx: Ticket, given: Approval | Remark) -> None:
        ctx.note = given.note


    ticket_flow = Workflow("ticket", context=Ticket, key="ticket_id")


    @ticket_flow.step(initial=True, next="review")
    def open_ticket(ctx: Ticket) -> None: ...


    ticket_flow.wait(
        "review",
        on={"approve": "second", "remark": "review", "hold": "held"},
        payloads={"approve": Approval, "remark": Remark},
        handlers={"approve": noted, "remark": noted},
    )
    ticket_flow.wait("held", on={"release": "review"})
    ticket_flow.wait("second", on={"approve": "done"})  # no payload model: any payload
    ticket_flow.final("done")
"""


def test_send__an_aliased_field_is_taken_by_the_keys_pydantic_takes(
    here: Path, store_url: str
) -> None:
    """Before: a field's name counted as taken whatever its model's config: `note` for a
    field aliased `comment` was suggested and accepted, and pydantic, validating by alias,
    dropped it without a word."""
    (here / "workflows" / "tickets.py").write_text(textwrap.dedent(TICKETS).lstrip())
    context = '{"ticket_id": "T1"}'
    run = as_json("run", "workflows/tickets.py", "--context", context, "--db", store_url, cwd=here)
    run_id = run["run"]["id"]

    def send(*args: str) -> str:
        return quick("send", run_id, *args, "--db", store_url, cwd=here)

    data = '{"by": "ann", "note": "rush"}'
    line = refused("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert line == (
        "error: --data: no field 'note' in Approval, the payload of 'approve' (fields: by, comment)"
    )
    assert send("approve", "--data", '{"by": "ann", "coment": "rush"}') == (
        "error: --data: no field 'coment' in Approval, the payload of 'approve'; "
        "did you mean 'comment'? (fields: by, comment)"
    )
    # A model that validates by name too takes both.
    for data in ('{"note": "one"}', '{"comment": "two"}'):
        sent = as_json("send", run_id, "remark", "--data", data, "--db", store_url, cwd=here)
        assert sent["result"] == "applied"
    assert sent["run"]["context"]["note"] == "two"
    assert send("remark", "--data", '{"nte": "x"}') == (
        "error: --data: no field 'nte' in Remark, the payload of 'remark'; "
        "did you mean 'note'? (fields: note, comment)"
    )
    data = '{"by": "ann", "comment": "rush"}'
    sent = as_json("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert (sent["result"], sent["run"]["state"]) == ("applied", "second")
    assert sent["run"]["context"]["note"] == "rush"


def test_send__buffer_takes_a_payload_a_wait_without_a_model_takes(
    here: Path, store_url: str
) -> None:
    """Before: `send --buffer` was refused for a key the one payload model has not, though
    another wait state taking the event has no model (it takes any payload, and the engine
    keeps it); and a run not waiting for the event at all was told of a field, not that."""
    (here / "workflows" / "tickets.py").write_text(textwrap.dedent(TICKETS).lstrip())
    context = '{"ticket_id": "T2"}'
    run = as_json("run", "workflows/tickets.py", "--context", context, "--db", store_url, cwd=here)
    run_id = run["run"]["id"]
    sent = as_json("send", run_id, "hold", "--db", store_url, cwd=here)
    assert sent["run"]["state"] == "held"
    data = '{"by": "ann", "signed": true}'
    line = refused("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert not line.startswith("error: --data"), line  # (the run's state takes no approve)
    assert "approve" in line and "release" in line, line
    args = ("send", run_id, "approve", "--buffer", "--data", data, "--db", store_url)
    assert as_json(*args, cwd=here)["result"] == "buffered"
    # Back in review, the kept approve is taken (by Approval, which ignores `signed`).
    sent = as_json("send", run_id, "release", "--db", store_url, cwd=here)
    assert sent["run"]["state"] == "second"
    sent = as_json("send", run_id, "approve", "--data", data, "--db", store_url, cwd=here)
    assert sent["run"]["state"] == "done"
    # A run that has ended: the send's own refusal, not a field's.
    args = ("send", run_id, "approve", "--buffer", "--data", '{"nte": 1}', "--db", store_url)
    line = quick(*args, cwd=here)
    assert not line.startswith("error: --data"), line


# -- 4: --context @DIR ---------------------------------------------------------------------


def test_context_from_a_directory__says_it_is_one(here: Path) -> None:
    """Before: `--context @workflows: no such file`, of a folder that is there."""
    line = refused("run", "workflows/orders.py", "--context", "@workflows", cwd=here)
    assert line == "error: --context @workflows: a directory, not a file; give @FILE.json"
    line = quick("send", "abcd1234", "approve", "--data", "@workflows/", cwd=here)
    assert line == "error: --data @workflows/: a directory, not a file; give @FILE.json"
    line = quick("start", "workflows/orders.py", "--contexts", "workflows", cwd=here)
    assert line == "error: --contexts workflows: a directory, not a file; give a .jsonl file"
    assert not (here / "flowloop.db").exists()


def test_context_from_no_file__says_none_was_given(here: Path) -> None:
    """Before: `--context @: a directory, not a file` (the empty path is the current
    directory), and `--contexts '': a directory` too."""
    line = refused("run", "workflows/orders.py", "--context", "@", cwd=here)
    assert line == "error: --context @: no file given after @; give @FILE.json"
    line = quick("send", "abcd1234", "approve", "--data", "@", cwd=here)
    assert line == "error: --data @: no file given after @; give @FILE.json"
    line = quick("start", "workflows/orders.py", "--contexts", "", cwd=here)
    assert line == "error: --contexts '': no file given; give a .jsonl file (or - for stdin)"
    assert not (here / "flowloop.db").exists()


# -- 5: a bad sslmode in a PostgreSQL URL --------------------------------------------------


def test_database_url__a_bad_sslmode_is_that_setting_exit_2(here: Path, pg_url: str) -> None:
    """Before: exit 1, `cannot use database …: the database server is unreachable
    (connection is bad: invalid sslmode value: "requir")` — and a worker waited for the
    database for ever, as for a server that is down."""
    url = f"{pg_url}{'&' if '?' in pg_url else '?'}sslmode=requir"
    line = refused("status", "--db", url, cwd=here)
    assert line == (
        "error: sslmode='requir' in the database URL is not a PostgreSQL SSL mode; "
        "did you mean 'require'?"
    )
    assert refused("worker", "--db", url, cwd=here) == line
    both = f"{url}x&sslmode=no"  # (each value given is checked)
    line = quick("run", "workflows/orders.py", "--context", CONTEXT, "--db", both, cwd=here)
    assert line == (
        "error: sslmode='requirx' in the database URL is not a PostgreSQL SSL mode; "
        "did you mean 'require'?"
    )


# -- 7: a group without its command under click 8.1 ----------------------------------------


def _like_click_8_1(original: object) -> object:
    """click 8.1's Group.parse_args: a group given no command printed its help on stdout
    and exited 0 (8.2 raises NoArgsIsHelpError: the help on stderr, exit 2)."""

    def parse_args(self: click.Group, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit()
        return original(self, ctx, args)  # type: ignore[operator,no-any-return]

    return parse_args


@pytest.mark.parametrize("args", [[], ["db"]])
def test_a_group_without_a_command__help_and_exit_2_under_click_8_1_too(
    tmp_path: Path, args: list[str]
) -> None:
    """pyproject allows click 8.1, under which `flowloop db` exited 0, its help on stdout;
    8.2 and later exit 2 with it on stderr. Checked by hand under a real click 8.1.7."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(click.Group, "parse_args", _like_click_8_1(click.Group.parse_args)),
        contextlib.chdir(tmp_path),
        mock.patch.dict(os.environ, clean_env(), clear=True),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        pytest.raises(SystemExit) as exited,
    ):
        main(args)
    assert exited.value.code == 2
    assert stdout.getvalue() == ""
    assert stderr.getvalue().startswith("Usage: ") and "Commands:" in stderr.getvalue()


def test_a_misspelt_command__the_one_meant_under_click_8_1_too(tmp_path: Path) -> None:
    """Click 8.1 has no NoSuchCommand: its "No such command 'stauts'." named none meant."""
    with mock.patch.object(flowloop.cli, "_NO_SUCH_COMMAND", None):
        line = quick("stauts", cwd=tmp_path)
    assert line.startswith("error: no such command 'stauts'; did you mean stats or status? (")
