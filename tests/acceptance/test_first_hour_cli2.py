"""The first hour of a new user at the command line, second audit: what the first one
(test_first_hour_cli.py) noticed and left alone. Each mistake is one line on stderr, no
traceback, exit 2; what worked before prints what it printed."""

from __future__ import annotations

import contextlib
import io
import os
import textwrap
from pathlib import Path
from unittest import mock

import click
import pytest
from test_first_hour_cli import as_json, clean_env, here_cli, quick, refused

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


def test_status__a_misspelt_workflow_is_refused_with_the_one_meant(
    here: Path, store_url: str
) -> None:
    """Before: `no runs with workflow 'ordr'`, exit 0, as for a workflow that is quiet."""
    started(here, store_url, "A1")
    line = refused("status", "--workflow", "ordr", "--db", store_url, cwd=here)
    assert line == "error: no workflow 'ordr' in this database; did you mean 'order'?"
    line = quick("status", "--workflow", "zzz", "--json", "--db", store_url, cwd=here)
    assert line == "error: no workflow 'zzz' in this database (known: order)"
    # A workflow that is there, with no run that matches: as before.
    shown = here_cli(
        "status", "--workflow", "order", "--status", "failed", "--db", store_url, cwd=here
    )
    assert shown == "no runs with workflow 'order', status failed\n"
    # Defined in ./workflows, never run on this database: no runs of it yet, as before.
    (here / "workflows" / "invoices.py").write_text(textwrap.dedent(INVOICES).lstrip())
    shown = here_cli("status", "--workflow", "invoice", "--db", store_url, cwd=here)
    assert shown == "no runs with workflow 'invoice'\n"
    assert as_json("status", "--workflow", "order", "--db", store_url, cwd=here)["runs"]


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
