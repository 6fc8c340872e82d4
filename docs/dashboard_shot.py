"""Take docs/dashboard-run.png, the README's screenshot of the dashboard's run page: the
example order workflow (workflows/order.py) with a few runs in a fresh database — delivered
at once, approved by a person, out of stock, rolled back — the real dashboard served on
loopback, the page of the approved order opened in headless Chromium.

    .venv/bin/python docs/dashboard_shot.py    # needs flowloop[ui], Playwright, Debian's chromium
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from playwright.sync_api import sync_playwright

from flowloop import Engine
from flowloop.loader import load_paths
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "dashboard-run.png"
HOST = "127.0.0.1"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1280, "height": 1000}
WAIT_MS = 15_000
TIMELINE_ROWS = 7
"""The timeline rows the picture shows (up to the child's join)."""


def fill(url: str) -> str:
    """A few orders of every outcome; returns the id of the one to show."""
    workflows = load_paths([ROOT / "workflows" / "order.py"]).workflows
    order = workflows["order"]
    with Engine(url, workflows=list(workflows.values())) as engine:
        engine.run(order, {"order_id": "A1", "items": [{"sku": "book", "qty": 2}]})
        engine.run(order, {"order_id": "A2", "items": [{"sku": "desk", "qty": 1}]})
        engine.run(
            order,
            {"order_id": "A3", "items": [{"sku": "lamp", "qty": 4}], "pack_fails": True},
        )
        shown = engine.run(order, {"order_id": "D1", "items": [{"sku": "chair", "qty": 3}]})
        assert shown.state == "awaiting_approval", shown
        engine.send(shown.id, "approve", {"by": "ann"})
        engine.run_until_idle()
        info = engine.get(shown.id)
        assert (info.status, info.state) == ("succeeded", "delivered"), info
        return shown.id


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("Debian's chromium is not installed (make browser installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'dashboard.db'}"
        run_id = fill(url)
        store = SQLStore(url, create=False)
        workflows = load_paths([ROOT / "workflows" / "order.py"]).workflows
        app = create_app(store, workflows=dict(workflows))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not listening(port):
                if time.monotonic() > deadline:
                    raise SystemExit("the dashboard did not start listening")
                time.sleep(0.02)
            with sync_playwright() as driver:
                browser = driver.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
                page.set_default_timeout(WAIT_MS)
                page.goto(f"http://{HOST}:{port}/runs/{run_id}")
                page.wait_for_selector("#diagram svg")
                page.wait_for_selector("#live-body[data-status=succeeded]")
                # The header, the whole machine and the first rows of the timeline below it.
                row = page.locator(f"#timeline tbody tr:nth-child({TIMELINE_ROWS})")
                box = row.bounding_box()
                assert box is not None
                height = box["y"] + box["height"]
                page.screenshot(
                    path=str(OUT),
                    full_page=True,
                    clip={"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height},
                )
                browser.close()
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            store.close()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
