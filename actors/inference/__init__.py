"""Inference: the SGLang HTTP client and the `local` SGLang-protocol server.

Nothing is imported eagerly here: the client must not pay for importing torch.
"""
