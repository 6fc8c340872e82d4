"""A polling loop: every 30 s, check a status feed and record what changed.

The "feed" here is a JSON file (``POLL_FEED``, default ./feed.json) so the example runs
anywhere; replace ``fetch`` with an HTTP call in real life. Start it with
``flowloop worker workflows/poll.py`` and watch it with ``flowloop loops``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flowloop.loops import Iteration, loop
from flowloop.retry import Retry

FEED = Path(os.environ.get("POLL_FEED", "feed.json"))
SEEN = Path(os.environ.get("POLL_SEEN", "feed.seen.json"))


def fetch() -> dict[str, str]:
    if not FEED.exists():
        return {}
    return dict(json.loads(FEED.read_text()))


@loop(
    every=float(os.environ.get("POLL_EVERY", "30")),
    mode="fixed_delay",
    timeout=10,
    retry=Retry(attempts=3, backoff="fixed", base=1, on=(OSError, ValueError)),
    max_failures=5,
)
def poll_feed(it: Iteration) -> int:
    current = fetch()
    seen = json.loads(SEEN.read_text()) if SEEN.exists() else {}
    changed = {key: value for key, value in current.items() if seen.get(key) != value}
    if changed:
        # Write-then-rename: a crash leaves the old or the new file, never half of one.
        tmp = SEEN.with_suffix(".tmp")
        tmp.write_text(json.dumps(current, sort_keys=True))
        tmp.replace(SEEN)
    return len(changed)
