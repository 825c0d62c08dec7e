"""The sim backend's HTTP server: the local server's app and handlers, with a :class:`SimEngine` inside.

Why: one HTTP layer, one protocol parser; only the engine differs. The local app loads a model on
start; here that start-up step is replaced by building a SimEngine (no model is loaded).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, replace
from typing import Any, Callable

from aiohttp import web

from actors.inference.local import server as local_server
from actors.inference.local.server import ServerConfig
from actors.inference.sim.engine import SimEngine
from actors.inference.sim.roofline import LengthModel, Roofline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimOptions:
    """The simulation's knobs on top of :class:`ServerConfig`."""

    roofline: Roofline = Roofline()
    lengths: LengthModel = LengthModel()
    time_scale: float = 1.0
    """Wall seconds per simulated second (0.01: a 100x faster-than-real fleet)."""
    token_scale: int = 1
    """Real tokens each synthetic output token stands for (``SimEngine``)."""


def _tokenizer(model_dir: str | None) -> Any:
    if model_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build_sim_app(config: ServerConfig, options: SimOptions = SimOptions()) -> web.Application:
    """The local server's application serving a SimEngine (SIMULATED compute, synthetic tokens)."""
    app = local_server.build_app(config)
    state = app[local_server._STATE]
    app.cleanup_ctx.clear()

    async def lifecycle(app: web.Application) -> Any:
        tokenizer = await asyncio.to_thread(_tokenizer, config.model_dir)
        engine = SimEngine(options.roofline, options.lengths, tokenizer, max_batch=config.max_batch,
                           time_scale=options.time_scale, token_scale=options.token_scale, seed=config.seed,
                           weight_version=config.weight_version)
        await engine.start()
        state.engine = engine  # type: ignore[assignment]  # same public API as LocalEngine
        log.info("SIMULATED inference server: %s, token_scale %d", options.roofline.describe(), options.token_scale)
        yield
        await engine.aclose()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve_sim(config: ServerConfig, options: SimOptions = SimOptions(), *, on_bound: Callable[[str, int], None] | None = None) -> None:
    """Serve until cancelled; same loopback/api-key rule as the local server; port 0 picks a free one."""
    if not config.api_key and not local_server.is_loopback(config.host):
        raise local_server.InsecureBindError(config.host)
    sock = socket.create_server((config.host, config.port))
    config = replace(config, port=int(sock.getsockname()[1]))
    runner = web.AppRunner(build_sim_app(config, options), access_log=None)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        if on_bound is not None:
            on_bound(config.host, config.port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        sock.close()
