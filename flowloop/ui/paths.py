"""A run id as one segment of a URL path, whatever it holds.

Ids are the engine's to choose (a subclass's ``_new_run_id``, rows another tool wrote):
one may hold ``/``, ``?``, ``#``, ``%`` or a space. Links carry it percent-encoded, ``/``
included (:func:`segment`; the page's script: ``encodeURIComponent``). The server decodes
the path before routing, and so ``%2F`` became a ``/`` that ended the route's segment: a
404. :class:`EncodedSlashes` routes the run paths (``/runs/…``, ``/api/runs/…``) on the
path as sent, ``%2F`` and ``%25`` left encoded, and the ``segment`` converter
(``{run_id:segment}``) decodes the id they are in.
"""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import quote, unquote

from starlette.convertors import Convertor, register_url_convertor
from starlette.types import ASGIApp, Receive, Scope, Send

RUN_PATHS: Final = ("/runs/", "/api/runs/")
_KEPT: Final = re.compile(r"(%2[fF]|%25)")


def segment(value: Any) -> str:
    """``value`` as one path segment: every reserved character encoded, ``/`` too."""
    return quote(str(value), safe="")


def _kept_encoded(raw: str) -> str:
    """``raw`` (a path as sent) decoded but for ``%2F`` and ``%25``: the decoded path, in
    which a ``/`` is one that separates segments."""
    parts = _KEPT.split(raw)  # (the kept ones at the odd places)
    return "".join(part.upper() if i % 2 else unquote(part) for i, part in enumerate(parts))


class SegmentConvertor(Convertor[str]):
    """One path segment, decoded (what :class:`EncodedSlashes` left encoded)."""

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        return unquote(value)

    def to_string(self, value: str) -> str:
        return segment(value)


register_url_convertor("segment", SegmentConvertor())


class EncodedSlashes:
    """Routes a run path on the path as sent, ``%2F`` and ``%25`` kept encoded (see the
    module). Only when the server's decoded path is that path decoded: else (a root path
    before it, no ``raw_path``) the request goes on as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" else None
        if raw and b"%" in raw and str(scope["path"]).startswith(RUN_PATHS):
            try:
                sent = raw.decode("ascii")
            except UnicodeDecodeError:
                sent = ""
            if sent and unquote(sent) == scope["path"]:
                scope = {**scope, "path": _kept_encoded(sent)}
        await self.app(scope, receive, send)
