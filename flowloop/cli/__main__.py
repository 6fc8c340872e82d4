"""``python -m flowloop.cli``: the ``flowloop`` command (what the tests' subprocesses run)."""

from __future__ import annotations

from flowloop.cli import main

if __name__ == "__main__":
    main()
