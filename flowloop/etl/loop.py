"""A loop that loads a folder's new files: every ``every`` seconds after the previous run
ended (``fixed_delay``); an iteration that finds no new file creates no run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from flowloop.definition import Workflow
from flowloop.etl.context import FolderContext
from flowloop.etl.loader import FolderLoader
from flowloop.loops import Loop

DEFAULT_EVERY_SECONDS = 10.0


def inbox_loop(
    name: str | None = None,
    *,
    workflow: Workflow,
    loader: FolderLoader,
    every: float | None = None,
    context: Mapping[str, Any] | None = None,
    max_failures: int = 5,
) -> Loop:
    """A loop (default name ``<workflow>_inbox``) running ``workflow`` over its context's
    input folder. ``every`` defaults to
    ``$<env_prefix>EVERY`` (else 10 s). Without an ``input_dir`` in ``context`` or
    ``$<env_prefix>INPUT`` the loop stays idle: ``flowloop worker workflows/`` must not load
    a bundled sample folder unasked."""
    context_type = workflow.context
    assert context_type is not None and issubclass(context_type, FolderContext)
    prefix = context_type.env_prefix
    interval = (
        every
        if every is not None
        else float(os.environ.get(f"{prefix}EVERY") or DEFAULT_EVERY_SECONDS)
    )
    fixed = dict(context or {})

    def when_new_files(_iteration: Any) -> FolderContext | None:
        # None: nothing to do, no run (journaled iteration_skipped_idle).
        if "input_dir" not in fixed and not os.environ.get(f"{prefix}INPUT"):
            return None
        ctx = context_type.model_validate(fixed)
        return ctx if has_new_files(loader, ctx) else None

    return Loop(
        name or f"{workflow.name}_inbox",
        workflow=workflow,
        context=when_new_files,
        every=interval,
        mode="fixed_delay",
        max_failures=max_failures,
    )


def has_new_files(loader: FolderLoader, ctx: FolderContext) -> bool:
    """Whether the input folder may hold a file to load: one whose name, size and mtime
    match no loaded file (discovery then checks its content). A missing folder or target
    is ``True``: the run says what is wrong."""
    folder = Path(ctx.input_dir)
    if not ctx.trust_mtime or not folder.is_dir():
        return True
    seen = {
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.glob(ctx.pattern)
        if p.is_file() and not p.name.startswith(".")
    }
    if not seen:
        return False
    files = loader.loaded_files
    try:
        with loader.engine(ctx.target).connect() as conn:
            known = conn.execute(sa.select(files.c.file, files.c.size, files.c.mtime_ns)).all()
    except sa.exc.SQLAlchemyError:
        return True
    return bool(seen - {(r.file, r.size, r.mtime_ns) for r in known})
