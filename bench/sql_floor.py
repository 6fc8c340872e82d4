"""The floor of flowloop's own write design: its SQL for a whole run, with no engine around it.

``seq_steps.py`` compares flowloop with a hand-written Core loop whose tables have no
index but their keys. This script asks what flowloop's *statements* cost by themselves: it
records, at the driver, every statement one ``engine.run()`` of a ``--steps``-step
workflow of trivial steps sends to SQLite (creation, the boundaries' fenced appends, the
end; checked to be one run's writes and nothing else), then replays that sequence on the
stdlib sqlite3 driver, run after run, with a new run id each time (made as flowloop makes
them: time-ordered) and nothing else around it. Programs, alternated, each on a fresh
file (WAL, ``synchronous=NORMAL``; the WAL checkpointed on a thread and the automatic
checkpoint raised to 10,000 pages, as flowloop's store and ``seq_steps.py``'s
``core_apart`` have it):

* ``flowloop``: ``engine.run()`` per run, ``async def`` steps;
* ``replay``: flowloop's recorded statements on the stdlib driver;
* ``replay, runs keys only``: the same on a file whose runs table keeps only its primary
  key and unique indexes; dropped are its secondary indexes (those the claims, a
  worker's owned runs, children, joins and limits read, and the listings of ``status``,
  the dashboard, ``prune`` and ``stats``): what they cost the writes;
* ``lean loop``: the least Python a run of this protocol needs around those statements:
  at each step's fenced append the context parsed from the text the previous boundary
  wrote, the step called, the context dumped, a timestamp, the append sent with those
  values;
* ``Core apart``: ``seq_steps.py``'s Core loop (one transaction per boundary) with the same
  checkpoint thread;
* ``floor``: ``seq_steps.py``'s stdlib loop (the Core loop's SQL on the stdlib driver).

What the gap between ``flowloop`` and ``replay`` measures is flowloop's Python per step;
``replay`` against ``Core apart`` says whether the write design alone leaves room for the
issue-13 target of 1.5x the Core loop, and ``lean loop`` whether Python around it does.
Every replayed run is checked to have written what the recorded one did (a fenced append
that found no lease would insert nothing, and cost less).

    python bench/sql_floor.py                 # ~2-3 min
    python bench/sql_floor.py --quick         # smoke run
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import sqlite3
import sqlite3.dbapi2
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import common
import seq_steps

from flowloop import Engine, runids

Statement = tuple[str, tuple[Any, ...]]
COMMIT: Statement = ("COMMIT", ())
ROLLBACK: Statement = ("ROLLBACK", ())

KEEP_INDEX_PREFIXES = ("sqlite_autoindex_", "ux_")
"""Indexes ``replay, runs keys only`` keeps on the runs table: the primary key's and the
unique ones (a business key, an idempotency key), which decide what a write may do."""


class _Recording:
    """What the recording connections sent while ``on``: the statements of the recording
    thread, and what could not be recorded as one run's statements (another thread's — a
    lease renewal —, a batch, a script, named parameters), raised once the run is over (an
    exception in another thread would be lost)."""

    on = False
    thread = 0
    statements: list[Statement] = []
    refused: list[str] = []


def _note(sql: str, parameters: Any) -> None:
    if not _Recording.on:
        return
    if threading.get_ident() != _Recording.thread:
        _Recording.refused.append(f"a statement of another thread: {sql[:80]}")
    elif isinstance(parameters, Mapping):
        _Recording.refused.append(f"named parameters: {sql[:80]}")
    else:
        _Recording.statements.append((sql, tuple(parameters)))


def _refuse(what: str) -> None:
    if _Recording.on:
        _Recording.refused.append(what)


class _RecordingCursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> Any:  # type: ignore[override]
        _note(sql, parameters)
        return super().execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> Any:  # type: ignore[override]
        _refuse(f"executemany (a batch of runs): {sql[:80]}")
        return super().executemany(sql, seq_of_parameters)

    def executescript(self, sql_script: str, /) -> Any:  # type: ignore[override]
        _refuse("executescript")
        return super().executescript(sql_script)


class _RecordingConnection(sqlite3.Connection):
    def cursor(self, factory: Any = _RecordingCursor) -> Any:  # type: ignore[override]
        return super().cursor(factory)

    def execute(self, sql: str, parameters: Any = (), /) -> Any:  # type: ignore[override]
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> Any:  # type: ignore[override]
        return self.cursor().executemany(sql, parameters)

    def executescript(self, sql_script: str, /) -> Any:  # type: ignore[override]
        return self.cursor().executescript(sql_script)

    def commit(self) -> None:
        if self.in_transaction:
            _note(*COMMIT)
        super().commit()

    def rollback(self) -> None:
        if self.in_transaction:
            _note(*ROLLBACK)
        super().rollback()


@contextlib.contextmanager
def _recording_connections() -> Iterator[None]:
    """sqlite3 connections opened meanwhile (SQLAlchemy's, through ``dbapi2.connect``)
    record their statements while :attr:`_Recording.on`."""
    original = sqlite3.dbapi2.connect
    sqlite3.dbapi2.connect = functools.partial(original, factory=_RecordingConnection)
    try:
        yield
    finally:
        sqlite3.dbapi2.connect = original


def record_run(directory: str, steps: int) -> tuple[str, list[Statement]]:
    """The statements one warm ``engine.run()`` sends, and the run id they carry."""
    workflow = common.chain("floor_rec", steps, kind="async")
    with _recording_connections(), common.sqlite_file(directory, "recorded") as path:
        engine = Engine(f"sqlite:///{path}", workflows=[workflow])
        try:
            for _ in range(5):  # statements prepared, the context cache warm
                engine.run(workflow, common.Ctx())
            _Recording.statements, _Recording.refused = [], []
            _Recording.thread = threading.get_ident()
            _Recording.on = True
            try:
                info = engine.run(workflow, common.Ctx())
            finally:
                _Recording.on = False
        finally:
            engine.close()
    if info.status != "succeeded":
        raise SystemExit(f"the recorded run ended {info.status}, not succeeded")
    if _Recording.refused:
        raise SystemExit(f"sql_floor cannot replay the recorded run: {_Recording.refused[0]}")
    statements = list(_Recording.statements)
    _check_shape(statements, info.id, steps)
    return info.id, statements


def _is_append(sql: str) -> bool:
    """A fenced append: a journal row inserted only if the writer holds the lease."""
    return sql.startswith("INSERT INTO flowloop_journal") and " SELECT " in sql


def _kind(sql: str) -> str:
    """One letter per statement, for :func:`_check_shape`."""
    if sql in ("COMMIT", "ROLLBACK"):
        return sql[0]
    if sql.startswith("BEGIN"):
        return "B"
    if sql.startswith("INSERT INTO flowloop_runs"):
        return "R"
    if _is_append(sql):
        return "A"
    if sql.startswith("INSERT INTO flowloop_journal"):
        return "J"
    if sql.startswith("UPDATE flowloop_runs") and "RETURNING" not in sql:
        return "U"
    return "?"


def _check_shape(statements: Sequence[Statement], run_id: str, steps: int) -> None:
    """The recording is one run's writes and nothing else, as flowloop writes a run that
    goes straight through: its creation (the run row and its first entries in one
    transaction), one fenced append alone per step but the last, and the end (the last
    append and the run row's update in one transaction); every statement's parameters
    those its ``?`` take, the run id among them and nowhere inside another value."""
    shape = "".join(_kind(sql) for sql, _ in statements)
    if re.fullmatch(f"BRJ+C{'A' * (steps - 1)}BAUC", shape) is None:
        raise SystemExit(f"recorded an unexpected sequence of statements: {shape}")
    for sql, params in statements:
        if _kind(sql) in "BC":
            continue
        if sql.count("?") != len(params):
            raise SystemExit(f"recorded {len(params)} parameters for: {sql[:80]}")
        if not any(p == run_id for p in params) or any(
            isinstance(p, str) and run_id in p and p != run_id for p in params
        ):
            raise SystemExit(
                f"recorded a statement of another run, or the id inside a value: {sql[:80]}"
            )


def _fresh_schema(path: str, *, keys_only: bool) -> None:
    """flowloop's schema in a new file (an engine makes it), without the runs table's
    secondary indexes when ``keys_only`` (see :data:`KEEP_INDEX_PREFIXES`)."""
    Engine(f"sqlite:///{path}", workflows=[common.chain("floor_schema", 1)]).close()
    if not keys_only:
        return
    con = sqlite3.connect(path, isolation_level=None)
    try:
        names = [
            name
            for (name,) in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'flowloop_runs'"
            )
        ]
        for name in names:
            if not name.startswith(KEEP_INDEX_PREFIXES):
                con.execute(f'DROP INDEX "{name}"')
    finally:
        con.close()


def _id_positions(statements: Sequence[Statement], run_id: str) -> list[list[int]]:
    """For each statement, where the run id sits among its parameters."""
    return [[i for i, p in enumerate(params) if p == run_id] for _, params in statements]


def _with_id(params: tuple[Any, ...], positions: list[int], run_id: str) -> list[Any]:
    values = list(params)
    for i in positions:
        values[i] = run_id
    return values


def _timed(
    backend: seq_steps.Backend,
    statements: Sequence[Statement],
    warm: int,
    steps: int,
    *,
    keys_only: bool,
    make_one: Callable[[sqlite3.Connection], Callable[[], None]],
) -> dict[str, float]:
    """``warm`` then ``backend.runs`` runs of ``make_one(connection)()`` on a fresh file with
    flowloop's schema, on the stdlib driver, WAL checkpoints on a thread as flowloop's
    store has them; each run checked to have written what the recorded one did."""
    with backend.database() as url:
        path = url.removeprefix("sqlite:///")
        _fresh_schema(path, keys_only=keys_only)
        con = sqlite3.connect(path, isolation_level=None)
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("PRAGMA busy_timeout=30000")
        con.execute("PRAGMA wal_autocheckpoint=10000")
        one = make_one(con)
        with seq_steps.checkpoints_apart(path, "NORMAL"):
            for _ in range(warm):
                one()
            gc.collect()
            with common.Timer() as t:
                for _ in range(backend.runs):
                    one()
        _check_written(con, statements, warm + backend.runs)
        con.close()
    n = backend.runs * steps
    return t.per_step(n)


def replay_program(
    backend: seq_steps.Backend,
    run_id: str,
    statements: Sequence[Statement],
    steps: int,
    warm: int,
    *,
    keys_only: bool,
) -> common.Program:
    """The recorded statements, replayed ``backend.runs`` times, each run with a new id
    made as flowloop makes them (time-ordered: where a run's rows land in the indexes)."""
    positions = _id_positions(statements, run_id)

    def make_one(con: sqlite3.Connection) -> Callable[[], None]:
        cursor = con.cursor()

        def one() -> None:
            new_id = runids.new_run_id()
            for (sql, params), where in zip(statements, positions, strict=True):
                if sql == "COMMIT":
                    con.commit()
                else:
                    cursor.execute(sql, _with_id(params, where, new_id))

        return one

    def run(_round: int) -> Mapping[str, float]:
        figures = _timed(backend, statements, warm, steps, keys_only=keys_only, make_one=make_one)
        figures["commits"] = _transactions(statements) / steps
        figures["statements"] = _statement_count(statements) / steps
        return figures

    return run


def _append_slots(sql: str) -> dict[str, int]:
    """Where each column's value sits among a fenced append's parameters: the position of
    each ``?`` that an `` AS name`` follows (the values it selects)."""
    slots: dict[str, int] = {}
    for position, after in enumerate(sql.split("?")[1:]):
        named = re.match(r"\s+AS\s+(\w+)", after)
        if named is not None:
            slots[named.group(1)] = position
    return slots


def lean_program(
    backend: seq_steps.Backend,
    run_id: str,
    statements: Sequence[Statement],
    steps: int,
    warm: int,
) -> common.Program:
    """The least Python a run of this protocol needs, around flowloop's own statements:
    at each fenced append (a step's outcome; the last one inside the end's transaction),
    the context parsed from the text the previous boundary wrote (each step its own copy),
    the step called (plain ``def``: ``ctx.n += 1``), the context dumped to JSON, a
    timestamp, and the append sent with those values. The rest is replayed as recorded.
    No fold of a record, no events, no hooks: a floor, not an engine."""
    positions = _id_positions(statements, run_id)
    slots = [_append_slots(sql) if _is_append(sql) else None for sql, _ in statements]

    def step(ctx: common.Ctx) -> None:
        ctx.n += 1

    def make_one(con: sqlite3.Connection) -> Callable[[], None]:
        cursor = con.cursor()

        def one() -> None:
            new_id = runids.new_run_id()
            text = common.Ctx().model_dump_json()
            for (sql, params), where, slot in zip(statements, positions, slots, strict=True):
                if sql == "COMMIT":
                    con.commit()
                    continue
                values = _with_id(params, where, new_id)
                if slot is not None:
                    ctx = common.Ctx.model_validate_json(text)
                    started = time.perf_counter()
                    step(ctx)
                    duration = time.perf_counter() - started
                    text = ctx.model_dump_json()
                    now = time.time()
                    values[slot["at"]] = now
                    values[slot["context"]] = text
                    values[slot["duration"]] = duration
                    if str(params[slot["data"]]).startswith('{"~then"'):  # a joined start
                        values[slot["data"]] = f'{{"~then":[{now!r},1]}}'
                cursor.execute(sql, values)

        return one

    def run(_round: int) -> Mapping[str, float]:
        return _timed(backend, statements, warm, steps, keys_only=False, make_one=make_one)

    return run


def _check_written(con: sqlite3.Connection, statements: Sequence[Statement], runs: int) -> None:
    """A fenced append that found no lease would insert nothing, and cost less: every
    replayed run must have written what the recorded one did."""
    entries = sum(1 for sql, _ in statements if sql.startswith("INSERT INTO flowloop_journal"))
    (rows,) = con.execute("SELECT count(*) FROM flowloop_journal").fetchone()
    (done,) = con.execute(
        "SELECT count(*) FROM flowloop_runs WHERE status = 'succeeded'"
    ).fetchone()
    if rows != runs * entries or done != runs:
        raise SystemExit(
            f"the replay wrote {rows} entries and finished {done} runs, "
            f"not {runs * entries} and {runs}"
        )


def _statement_count(statements: Sequence[Statement]) -> int:
    """Statements other than BEGIN/COMMIT/ROLLBACK (the recording holds only inserts and
    updates besides those: :func:`_check_shape`)."""
    return sum(
        1
        for sql, _ in statements
        if not sql.strip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK"))
    )


def _transactions(statements: Sequence[Statement]) -> int:
    """Commits the sequence makes: each BEGIN's transaction, and each statement sent alone
    (autocommit) outside one."""
    count, inside = 0, False
    for sql, _ in statements:
        word = sql.strip().split(None, 1)[0].upper() if sql.strip() else ""
        if word == "BEGIN":
            inside = True
        elif word in ("COMMIT", "ROLLBACK"):
            count += word == "COMMIT"
            inside = False
        elif not inside:
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs per sample (default 1000)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    p.add_argument("--warm", type=int, default=None, help="warm-up runs per sample")
    args = p.parse_args(argv)
    runs = args.runs or (30 if args.quick else 1000)
    warm = args.warm if args.warm is not None else (5 if args.quick else 50)
    rounds = common.rounds_for(args)
    with common.data_dir(args.dir) as directory:
        info = common.machine(None, directory)
        common.header(
            "sql_floor: flowloop's own SQL replayed without flowloop",
            info,
            {
                "workflow": f"{args.steps} trivial async def steps per run, sequential runs",
                "runs": f"{runs} per sample after {warm} warm-up runs, {rounds} rounds",
                "database": "SQLite WAL, synchronous=NORMAL, checkpoints on a thread",
            },
        )
        run_id, statements = record_run(directory, args.steps)
        print(
            f"recorded: {len(statements)} driver calls per run, "
            f"{_statement_count(statements)} statements, {_transactions(statements)} commits"
        )
        for sql, _ in statements:
            print(f"  {' '.join(sql.split())[:110]}")
        backend = seq_steps.Backend("sqlite", "sqlite", "NORMAL", runs, directory=directory)
        programs = {
            "flowloop": seq_steps.flowloop_program(backend, args.steps, warm, "async"),
            "replay": replay_program(
                backend, run_id, statements, args.steps, warm, keys_only=False
            ),
            "replay, runs keys only": replay_program(
                backend, run_id, statements, args.steps, warm, keys_only=True
            ),
            "lean loop": lean_program(backend, run_id, statements, args.steps, warm),
            "Core apart": seq_steps.core_program(backend, args.steps, warm, apart=True),
            "floor": seq_steps.floor_program(backend, args.steps, warm),
        }
        results = common.alternate(list(programs.items()), rounds)
        rows = [
            [
                name,
                common.fmt_spread(results, name, "steps_per_s", 0),
                common.fmt_spread(results, name, "us_per_step", 1),
                common.fmt_spread(results, name, "cpu_us_per_step", 1),
            ]
            for name in programs
        ]
        common.table(["program", "steps/s", "µs/step", "CPU µs/step"], rows)
        core = results.median("Core apart", "steps_per_s")
        ours = results.median("flowloop", "steps_per_s")
        print()
        print("Ratios (medians) to the Core loop with the same checkpoint thread:")
        ratio_rows = [
            [name, f"{results.median(name, 'steps_per_s') / core:.2f}x"]
            for name in ("flowloop", "lean loop", "replay", "replay, runs keys only", "floor")
        ]
        common.table(["program", "vs Core apart"], ratio_rows)
        replay_us = results.median("replay", "us_per_step")
        flowloop_us = results.median("flowloop", "us_per_step")
        print(
            f"flowloop's Python per step (flowloop - replay): {flowloop_us - replay_us:.1f} µs; "
            f"flowloop / replay: {ours / results.median('replay', 'steps_per_s'):.2f}x"
        )
        common.write_json(args.json, {"machine": info, "results": results.to_json()})
        common.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
