"""The dashboard's two routes: the page (``GET /dashboard``) and its data (``GET /dashboard/data``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Protocol

from aiohttp import web


class DataSource(Protocol):
    """What the routes read: :class:`~ops.dashboard.recorder.Recorder` is one."""

    def data(self) -> dict[str, Any]: ...


def _page() -> str:
    return resources.files("ops.dashboard").joinpath("index.html").read_text(encoding="utf-8")


def dashboard_routes(app: web.Application, source: DataSource) -> None:
    """Add ``GET /dashboard`` and ``GET /dashboard/data`` to ``app`` (HttpServer's ``extra_routes``)."""
    page = _page()

    async def dashboard(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def data(request: web.Request) -> web.Response:
        return web.json_response(source.data(), headers={"Cache-Control": "no-store"},
                                 dumps=lambda obj: json.dumps(obj, default=str))

    app.add_routes([web.get("/dashboard", dashboard), web.get("/dashboard/data", data)])
