"""The web dashboard (``flowloop ui``): runs, loops and live diagrams in the browser.

Read-only by default. Modules: :mod:`~flowloop.ui.queries` (read SQL on the store's
tables), :mod:`~flowloop.ui.diagrams` (SVG from :mod:`flowloop.render`, cached),
:mod:`~flowloop.ui.api` (the JSON API and its OpenAPI document), :mod:`~flowloop.ui.pages`
(HTML pages), :mod:`~flowloop.ui.actions` (operator actions behind a token and CSRF),
:mod:`~flowloop.ui.app` (the Starlette app factory); the ``flowloop ui`` click command is
:mod:`flowloop.cli.ui`. Everything the pages load is served from ``static/``.
"""
