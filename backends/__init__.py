"""The backends layer: a small contract, real implementations, and a registry.

Backends import their library only when first used; see :mod:`wasinn.backends.registry`.
"""

from .base import Backend, BackendRef, Builders, CompiledGraph, Device, LoadOptions, TensorSpec
from .formats import detect_encoding
from .registry import DEFAULT_PREFERENCE, BackendRegistry, BackendSpec

__all__ = [
    "DEFAULT_PREFERENCE",
    "Backend",
    "BackendRef",
    "BackendRegistry",
    "BackendSpec",
    "Builders",
    "CompiledGraph",
    "Device",
    "LoadOptions",
    "TensorSpec",
    "detect_encoding",
]
