""" "Did you mean …?" for a name the user typed: a command, a workflow file, a workflow, an
event's field. One spelling of the hint everywhere: ``did you mean stats or status?``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

CUTOFF = 0.6
"""difflib's default: ``ordr`` finds ``order``, ``stauts`` finds ``status``."""


def close_names(
    word: str, names: Iterable[str], *, n: int = 2, cutoff: float = CUTOFF
) -> list[str]:
    """Up to ``n`` of ``names`` spelt close to ``word``, the closest first."""
    import difflib  # (only on a mistake's path: a command's start stays brief)

    return difflib.get_close_matches(word, list(names), n=n, cutoff=cutoff)


def did_you_mean(
    word: str,
    names: Iterable[str],
    *,
    n: int = 2,
    cutoff: float = CUTOFF,
    shown: Callable[[str], str] = str,
) -> str:
    """``did you mean A or B?`` (each name as ``shown`` spells it), or ``""`` when none of
    ``names`` is close to ``word``."""
    close = close_names(word, names, n=n, cutoff=cutoff)
    return f"did you mean {' or '.join(shown(name) for name in close)}?" if close else ""
