"""A simulated inference backend: the real SGLang HTTP layer over an engine whose compute is a roofline model.

Everything here is SIMULATED timing; tokens are synthetic. See docs/fleet.md.
"""
