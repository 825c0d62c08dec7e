"""The `local` inference backend: a Hugging Face causal LM served over SGLang's native HTTP API."""

from modelserver.local.engine import LocalEngine, Sequence, WeightUpdateError
from modelserver.local.server import ServerConfig, build_app, serve

__all__ = ["LocalEngine", "Sequence", "ServerConfig", "WeightUpdateError", "build_app", "serve"]
