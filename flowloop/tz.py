"""Loops in time zones: IANA zone names and the daylight-saving policy (pure, no I/O).

A cron loop with ``tz="Europe/Berlin"`` reads its expression on that zone's wall clock;
every slot is still stored and compared as UTC epoch seconds. The DST policy (the one
Debian's cron follows, and the one the README documents):

* **A schedule at a fixed wall time** (both the minute and the hour field are numbers or
  lists, e.g. ``30 2 * * *``): it fires once per matching wall-clock time.

  - *Spring forward* (02:00 → 03:00 in Berlin on the last Sunday of March): a time that does
    not exist that night (02:30) fires at the first wall time after the gap — **03:00** —
    once. It is not skipped.
  - *Fall back* (03:00 → 02:00 on the last Sunday of October): a time that happens twice
    (02:30 CEST and 02:30 CET) fires **once**, at the first occurrence (02:30 CEST).

* **A schedule in elapsed time** (the minute or the hour field starts with ``*``:
  ``0 * * * *``, ``*/15 * * * *``, ``0 */2 * * *``): it follows real time. An hourly job
  fires once per real hour — 23 times on the spring-forward day, 25 on the fall-back day —
  never two firings in one real hour and never a real hour without one.

The zone data come from the system's zoneinfo (Debian's ``tzdata``), through
:mod:`zoneinfo`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError


class UnknownTimeZone(ValueError):
    """Not an IANA time-zone name this machine knows."""


@lru_cache(maxsize=256)
def zone(name: str) -> ZoneInfo:
    """The :class:`~zoneinfo.ZoneInfo` for an IANA name (``Europe/Berlin``, ``UTC``).

    Raises :class:`UnknownTimeZone` (a ``ValueError``) with a message naming the value when
    it is not a zone name known to this machine."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise UnknownTimeZone(f"tz={name!r} is not an IANA time-zone name (e.g. 'Europe/Berlin')")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise UnknownTimeZone(
            f"tz={name!r} is not an IANA time-zone name known here (e.g. 'Europe/Berlin', "
            "'America/New_York', 'UTC'; the list is in /usr/share/zoneinfo)"
        ) from None


def wall_time_schedule(expression: str) -> bool:
    """True when the cron expression names fixed wall-clock times (DST-adjusted), False when
    it runs in elapsed time (its minute or hour field starts with ``*``)."""
    fields = expression.split()
    return len(fields) >= 2 and not fields[0].startswith("*") and not fields[1].startswith("*")


def local(moment: float, name: str | None) -> datetime:
    """The aware datetime of UTC epoch seconds ``moment`` in zone ``name`` (None: UTC)."""
    return datetime.fromtimestamp(moment, UTC if name is None else zone(name))


def describe(moment: float, name: str | None) -> str:
    """``2026-03-29 03:00 CEST`` — a slot as its zone's wall clock shows it (listings)."""
    shown = local(moment, name)
    return shown.strftime("%Y-%m-%d %H:%M %Z")


def in_gap(wall: datetime, name: str | None) -> bool:
    """Whether the naive wall-clock time ``wall`` does not exist in zone ``name`` (it falls
    in a spring-forward gap: 02:30 on Berlin's last Sunday of March)."""
    if name is None:
        return False
    tz = zone(name)
    moment = wall.replace(tzinfo=tz).timestamp()
    return datetime.fromtimestamp(moment, tz).replace(tzinfo=None) != wall


def wall_epoch(wall: datetime, name: str | None) -> float:
    """UTC epoch seconds of the naive wall-clock time ``wall`` in zone ``name`` (None: UTC),
    under the policy above: a time that happens twice (fall back) is its first occurrence
    (its second with ``fold=1``); one that does not exist (spring forward) is the first
    moment after the gap (02:30 on Berlin's spring-forward night is 03:00 CEST)."""
    if name is None:
        return wall.replace(tzinfo=UTC).timestamp()
    tz = zone(name)
    if not in_gap(wall, name):
        return wall.replace(tzinfo=tz).timestamp()
    # In a gap: fold=1 reads it with the offset after the change (a moment before it),
    # fold=0 with the one before (a moment after it); the change lies between them.
    before = wall.replace(tzinfo=tz, fold=1).timestamp()
    after = wall.replace(tzinfo=tz, fold=0).timestamp()
    offset = datetime.fromtimestamp(after, tz).utcoffset()
    while after - before > 1e-3:
        middle = (before + after) / 2
        if datetime.fromtimestamp(middle, tz).utcoffset() == offset:
            after = middle
        else:
            before = middle
    return float(round(after))  # zone changes fall on whole seconds
