"""Draw docs/order-run.svg, the run overlay the README shows: an order that waits for
approval, is approved, has its first payment attempt refused (retried) and is delivered.

    .venv/bin/python docs/order_run.py      # needs Graphviz's `dot`
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from flowloop import Engine, FakeClock, render
from flowloop.loader import load_target

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    workflow, _ = load_target(str(ROOT / "workflows" / "order.py"))
    out = ROOT / "docs" / "order-run.svg"
    with (
        tempfile.TemporaryDirectory() as tmp,
        Engine(str(Path(tmp) / "docs.db"), clock=FakeClock()) as engine,
    ):
        engine.register(workflow)
        context = {"order_id": "D1", "items": [{"sku": "chair", "qty": 3}]}
        run = engine.start(workflow, context)
        engine.run_until_idle()
        engine.send(run.id, "approve", {"by": "ann"})
        engine.run_until_idle()
        assert engine.get(run.id).status == "succeeded"
        render.save(engine.diagram(run.id), out, "svg")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
