"""``python -m flowloop``: the ``flowloop`` command."""

from __future__ import annotations

from flowloop.cli import main

if __name__ == "__main__":
    main()
