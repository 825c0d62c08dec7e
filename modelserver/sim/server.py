"""The sim backend's HTTP server: the local server's app and handlers, with a :class:`SimEngine` inside.

Why: one HTTP layer, one protocol parser; only the engine differs. The local app loads a model on
start; here that start-up step (``start_engine``) builds a SimEngine instead (no model is loaded).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from modelserver.local import server as local_server
from modelserver.local.server import ServerConfig
from modelserver.sim.engine import SimEngine
from modelserver.sim.roofline import LengthModel, Roofline

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


def _sim_starter(options: SimOptions) -> local_server.EngineStarter:
    async def start(state: local_server.ServerState) -> None:
        config = state.config
        try:
            tokenizer = await asyncio.to_thread(_tokenizer, config.model_dir)
        except Exception as exc:
            log.exception("tokenizer load failed")
            state.load_error = f"tokenizer load failed: {exc!r}"
            state.load_failed.set()
            return
        engine = SimEngine(options.roofline, options.lengths, tokenizer, max_batch=config.max_batch,
                           time_scale=options.time_scale, token_scale=options.token_scale, seed=config.seed,
                           weight_version=config.weight_version)
        await engine.start()
        state.engine = engine  # type: ignore[assignment]  # same public API as LocalEngine
        log.info("SIMULATED inference server: %s, token_scale %d", options.roofline.describe(), options.token_scale)

    return start


def build_sim_app(config: ServerConfig, options: SimOptions = SimOptions()) -> web.Application:
    """The local server's application serving a SimEngine (SIMULATED compute, synthetic tokens)."""
    return local_server.build_app(config, _sim_starter(options))


async def serve_sim(config: ServerConfig, options: SimOptions = SimOptions(), *, on_bound: Callable[[str, int], None] | None = None) -> None:
    """Serve until cancelled; the local server's :func:`~modelserver.local.server.serve` (same
    loopback/api-key rule, port 0 picks a free one) with a SimEngine in place of the model."""
    await local_server.serve(config, on_bound=on_bound, start_engine=_sim_starter(options))
