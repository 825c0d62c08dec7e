"""The `local` inference backend: a Hugging Face causal LM served over SGLang's native HTTP API."""

from actors.inference.local.engine import LocalEngine, Sequence, WeightUpdateError
from actors.inference.local.server import ServerConfig, build_app, serve

__all__ = ["LocalEngine", "Sequence", "ServerConfig", "WeightUpdateError", "build_app", "serve"]
