"""The standard folder-load workflow, built in one call (``workflows/etl.py`` spells the
same five steps out by hand, to show them)::

    discover --found--> open_file --ready--> load_batch --more--> load_batch (to itself)
       | nothing          | rejected ^ next     | eof
       v                  v          |          v
     report <--finished-- close_file <----------+        report --next--> done
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

from flowloop.definition import Step, Workflow
from flowloop.etl.context import FolderContext
from flowloop.etl.loader import MAX_BATCHES_PER_RUN, MAX_FILES_PER_RUN, FolderLoader
from flowloop.retry import Retry

TRANSIENT: Final = (sa.exc.OperationalError, sa.exc.InterfaceError, OSError)
"""What the steps retry: a target that is briefly unreachable or locked, a file system hiccup."""
RETRY_TRANSIENT: Final = Retry(attempts=5, backoff="exponential", base=0.5, cap=30, on=TRANSIENT)


def folder_workflow(
    name: str,
    loader: FolderLoader,
    *,
    context: type[FolderContext],
    version: int = 1,
    description: str = "",
    retry: Retry = RETRY_TRANSIENT,
    max_batches: int = MAX_BATCHES_PER_RUN,
    max_files: int = MAX_FILES_PER_RUN,
) -> Workflow:
    """A workflow ``name`` loading ``context``'s input folder with ``loader``: one batch per
    step (``load_batch`` loops to itself), at most ``max_batches`` batches and ``max_files``
    files per run (the rest waits for the next run), transient errors retried."""
    workflow = Workflow(name, context=context, version=version, description=description)

    @workflow.step(initial=True, on={"found": "open_file", "nothing": "report"}, retry=retry)
    def discover(ctx: FolderContext, step: Step) -> str:
        """Extract: the new files of the input folder, planned to fit the batch budget."""
        return loader.discover(ctx, max_batches=max_batches, max_files=max_files)

    @workflow.step(
        on={"ready": "load_batch", "rejected": "close_file"}, retry=retry, max_visits=max_files
    )
    def open_file(ctx: FolderContext, step: Step) -> str:
        """Check the file's header; a malformed file becomes one reject (row 0)."""
        return loader.open_file(ctx, step)

    @workflow.step(
        on={"more": "load_batch", "eof": "close_file"}, retry=retry, max_visits=max_batches
    )
    def load_batch(ctx: FolderContext, step: Step) -> str:
        """One batch from the committed offset: read, validate, transform, upsert."""
        return loader.load_batch(ctx, step)

    @workflow.step(
        on={"next": "open_file", "finished": "report"}, retry=retry, max_visits=max_files
    )
    def close_file(ctx: FolderContext, step: Step) -> str:
        """Record the file in ``loaded_files`` so no run takes it again."""
        return loader.close_file(ctx, step)

    @workflow.step(next="done", retry=retry)
    def report(ctx: FolderContext, step: Step) -> None:
        """Summarise the run and the target."""
        loader.report(ctx)

    workflow.final("done")
    return workflow
