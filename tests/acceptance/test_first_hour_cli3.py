"""The first hour of a new user at the command line, third audit: what the second one
(test_first_hour_cli2.py) noticed and left alone. Each mistake is one line on stderr, no
traceback, exit 2; what worked before prints what it printed."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest
from test_first_hour_cli import as_json, quick, refused
from test_first_hour_cli import flowloop as a_process
from test_first_hour_cli2 import CONTEXT, FLOW, started

from flowloop.loader import workflow_names_in


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A project as `flowloop` finds one: its workflow in ./workflows."""
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "orders.py").write_text(textwrap.dedent(FLOW).lstrip())
    return tmp_path


def with_query(url: str, setting: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{setting}"


# -- 1: a misspelt setting in a PostgreSQL URL's query ---------------------------------------


def test_database_url__a_misspelt_setting_names_the_one_meant_exit_2(
    here: Path, pg_url: str
) -> None:
    """Before: `cannot use database …?sslmod=require: invalid connection option "sslmod"`,
    exit 1 (the driver's words, as for a server that is down)."""
    url = with_query(pg_url, "sslmod=require")
    line = refused("status", "--db", url, cwd=here)
    assert line == (
        "error: 'sslmod' in the database URL is no PostgreSQL connection setting; "
        "did you mean 'sslmode'?"
    )
    assert refused("worker", "--db", url, cwd=here) == line
    assert quick("run", "workflows/orders.py", "--context", CONTEXT, "--db", url, cwd=here) == (
        line
    )
    assert quick("db", "upgrade", "--db", url, cwd=here) == line
    nothing_close = with_query(pg_url, "zzzqq=1")
    assert quick("status", "--db", nothing_close, cwd=here) == (
        "error: 'zzzqq' in the database URL is no PostgreSQL connection setting "
        "(see libpq's connection parameters)"
    )
    # No connection is tried: a host that never answers does not make it wait.
    unreachable = "postgresql+psycopg://postgres@192.0.2.1:5432/test?sslmod=require"
    assert quick("status", "--db", unreachable, cwd=here) == line
    assert not (here / "flowloop.db").exists()
    # Settings libpq knows work as before.
    known = with_query(pg_url, "application_name=first-hour&connect_timeout=5&sslmode=disable")
    assert started(here, known, "A1")
    assert [run["workflow"] for run in as_json("status", "--db", known, cwd=here)["runs"]] == [
        "order"
    ]


def test_database_url__a_value_libpq_refuses_only_when_connecting_is_refused_first(
    here: Path, pg_url: str
) -> None:
    """Before: `target_session_attrs=read_write`, `gssencmode=x`, `keepalives_idle=abc` or
    `sslmode` given twice failed when connecting as "the database server is unreachable
    (connection is bad: invalid … value)": a worker waited for the database for ever."""
    worker = refused(
        "worker", "--db", with_query(pg_url, "target_session_attrs=read_write"), cwd=here
    )
    assert worker == (
        "error: target_session_attrs='read_write' in the database URL is not one of its "
        "values; did you mean 'read-write'?"
    )
    lines = {
        "gssencmode=x": "error: gssencmode='x' in the database URL is not one of its values "
        "(use one of disable, prefer, require)",
        "keepalives_idle=abc": "error: keepalives_idle='abc' in the database URL is not a "
        "whole number",
        "keepalives_idle=%2B-5": "error: keepalives_idle='+-5' in the database URL is not a "
        "whole number",
        "sslmode=require&sslmode=disable": "error: sslmode is given twice in the database "
        "URL; give it once",
    }
    for setting, line in lines.items():
        assert quick("worker", "--db", with_query(pg_url, setting), cwd=here) == line
    assert not (here / "flowloop.db").exists()


# -- 2: send --workflow with a misspelt name ----------------------------------------------


def test_send__a_misspelt_workflow_suggests_the_one_meant(here: Path, store_url: str) -> None:
    """Before: `no run of workflow 'ordr' has key 'A1'; this database has no workflow
    'ordr' (known: order)`: a list where `status --workflow` says the name meant."""
    started(here, store_url, "A1")
    args = ("send", "A1", "approve", "--data", '{"by": "ann"}', "--db", store_url)
    assert refused(*args, "--workflow", "ordr", cwd=here) == (
        "error: no run of workflow 'ordr' has key 'A1'; this database has no workflow "
        "'ordr'; did you mean 'order'?"
    )
    assert quick(*args, "--workflow", "zzz", cwd=here) == (
        "error: no run of workflow 'zzz' has key 'A1'; this database has no workflow "
        "'zzz' (known: order)"
    )
    sent = as_json(*args, "--workflow", "order", cwd=here)
    assert (sent["result"], sent["run"]["state"]) == ("applied", "shipped")


# -- 3: the name meant, in a file that imports Workflow under another name -----------------

ALIASED = """
    from pydantic import BaseModel

    import flowloop as fl
    from flowloop import Workflow as W
    from flowloop import definition as d


    class Invoice(BaseModel):
        number: str


    invoice_flow = W("invoice", context=Invoice)
    refund_flow = fl.Workflow(name="refund", context=Invoice)
    credit_flow = d.Workflow("credit", context=Invoice)
    for flow in (invoice_flow, refund_flow, credit_flow):
        flow.step(initial=True, next="sent", name="send")(lambda ctx: None)
        flow.final("sent")
"""


def test_run__a_misspelt_name_finds_workflows_made_under_an_alias(here: Path) -> None:
    """Before: `error: invoise: no such file` and no more: the scan knew `Workflow(…)` and
    `flowloop.Workflow(…)` only. Still read, not imported."""
    aliased = here / "workflows" / "billing.py"
    aliased.write_text(textwrap.dedent(ALIASED).lstrip())
    assert workflow_names_in(aliased) == ["invoice", "refund", "credit"]
    line = refused("run", "invoise", "--context", '{"number": "7"}', cwd=here)
    assert line == "error: invoise: no such file; did you mean workflows/billing.py:invoice?"
    assert quick("start", "refnd", cwd=here) == (
        "error: refnd: no such file; did you mean workflows/billing.py:refund?"
    )
    assert quick("run", "credt", cwd=here) == (
        "error: credt: no such file; did you mean workflows/billing.py:credit?"
    )
    # The target suggested runs.
    shown = as_json("run", "workflows/billing.py:invoice", "--context", '{"number": "7"}', cwd=here)
    assert shown["run"]["status"] == "succeeded"


def test_run__an_alias_of_something_else_is_no_workflow(tmp_path: Path) -> None:
    """Only the names the file binds to flowloop's Workflow count: another module's
    ``Workflow`` imported under an alias, or a call of an attribute of another module, does
    not."""
    other = tmp_path / "other.py"
    other.write_text(
        "import elsewhere as fl\nfrom elsewhere import Workflow as W\n"
        "a = W('a')\nb = fl.Workflow('b')\nc = Workflow('c')\n"
    )
    assert workflow_names_in(other) == ["c"]


def test_status_by_process__a_misspelt_setting_has_no_traceback(here: Path) -> None:
    """Without a PostgreSQL server, in a process: the line, exit 2, nothing on stdout."""
    url = "postgresql://postgres@192.0.2.1:5432/test?sslmod=require"
    shown = a_process("status", "--db", url, cwd=here, code=2)
    assert shown.stdout == ""
    assert shown.stderr == (
        "error: 'sslmod' in the database URL is no PostgreSQL connection setting; "
        "did you mean 'sslmode'?\n"
    )


# -- the quick start: a business key given as the run id -----------------------------------


def test_send__a_key_as_run_id_names_a_command_that_works_as_printed(here: Path) -> None:
    """Before: `… flowloop send A1 approve --workflow order`, without the --data given:
    typed as printed, the event's payload failed to validate (`by: Field required`)."""
    started(here, "flowloop.db", "A1")
    line = refused(
        "send", "A1", "approve", "--data", '{"by": "ann"}', "--dedupe-key", "hook 1", cwd=here
    )
    assert line == (
        "error: no run 'A1'; it is the key of run(s) of order: flowloop send A1 approve "
        "--workflow order --data '{\"by\": \"ann\"}' --dedupe-key 'hook 1'"
    )
    # Typed as printed, it sends the event.
    printed = shlex.split(line.split(": ", 2)[2])
    assert printed[0] == "flowloop"
    sent = as_json(*printed[1:], cwd=here)
    assert (sent["result"], sent["run"]["state"]) == ("applied", "shipped")


# -- the quick start: other misspelt names that listed rather than suggested ----------------


def test_quick_start__a_misspelt_workflow_after_the_colon_or_status_is_suggested(
    here: Path,
) -> None:
    """Before: `no workflow 'ordr', by name or variable (it defines: order)` and `--status
    'runing' is not a status (one of …)`: the names listed, none suggested."""
    line = refused("run", "workflows/orders.py:ordr", "--context", CONTEXT, cwd=here)
    assert line == (
        "error: workflows/orders.py: no workflow 'ordr', by name or variable; did you mean "
        "'order'? (it defines: order)"
    )
    assert quick("run", "workflows/orders.py:zzz", cwd=here) == (
        "error: workflows/orders.py: no workflow 'zzz', by name or variable (it defines: order)"
    )
    started(here, "flowloop.db", "A1")
    assert quick("status", "--status", "runing", cwd=here) == (
        "error: --status 'runing' is not a status; did you mean 'running'? (one of waiting, "
        "held, scheduled, running, retrying, paused, succeeded, failed, stopped)"
    )


def test_database_url__urls_sqlalchemy_reads_are_not_refused(here: Path, pg_url: str) -> None:
    """Review: two hosts (SQLAlchemy's multi-host form), a blank value (SQLAlchemy drops
    it) and a fractional connect_timeout (psycopg takes it) connected before the check and
    were refused by it; a password with a "?" was cut there and its tail shown in the
    error. Each connects now; no secret reaches the message of one that is refused."""
    address = pg_url.partition("://")[2].partition("/")[0].rpartition("@")[2]
    database, _, query = pg_url.partition("://")[2].partition("/")[2].partition("?")
    base = f"postgresql+psycopg://postgres@/{database}?{query}"
    for setting in (
        f"host={address}&host={address}",
        f"host={address}&target_session_attrs=",
        f"host={address}&connect_timeout=5.5",
    ):
        url = f"{base}&{setting}"
        assert started(here, url, setting[-12:]), setting
    secret = pg_url.replace("postgres@", "postgres:s3cr?tpw@", 1)
    line = quick("status", "--db", with_query(secret, "sslmod=require"), cwd=here)
    assert "tpw" not in line and "sslmod" in line, line


def test_run__a_long_attribute_chain_is_no_workflow_and_no_crash(tmp_path: Path) -> None:
    """Review: ``ast.unparse`` of a chain of hundreds of attributes ran out of recursion
    (a traceback instead of the suggestion)."""
    chained = tmp_path / "chained.py"
    chained.write_text("y = x" + ".b" * 800 + ".Workflow('gen')\nz = Workflow('kept')\n")
    assert workflow_names_in(chained) == ["kept"]
