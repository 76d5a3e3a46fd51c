"""The compile properties wasinn gives OpenVINO, made from ``LoadOptions`` (for
:mod:`wasinn.backends.openvino`, and benchmarks compiling native models).

:func:`compile_config` checks each option against the properties the device supports
(asked once per core and device) and every property the installed OpenVINO declares
(:func:`known_properties`): another plugin's property is left out with a warning, a
misspelt one is InvalidArgumentError with the closest name, and one that
``LoadOptions``' own fields set (:mod:`._ov_options`) may not be set again.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
import types
from collections.abc import Sequence
from typing import Any

from wasinn.errors import InvalidArgumentError

from ._ov_options import SET_FROM_OPTIONS
from ._ovread import NAME
from .base import LoadOptions, log


def compile_config(core: Any, ov_device: str, options: LoadOptions) -> dict[str, Any]:
    """The compile properties wasinn uses; also used by benchmarks for native models.

    ``precision`` becomes ``INFERENCE_PRECISION_HINT`` where the device supports it
    (``"default"`` or ``""`` leaves the plugin's choice; ``"tf32"`` is f32); ``threads``
    becomes ``INFERENCE_NUM_THREADS`` (an ``extra`` entry setting either of those two as
    well is InvalidArgumentError); ``thread_pinning=False`` becomes
    ``ENABLE_CPU_PINNING`` false; ``extra`` entries named after a property the device
    supports (``PERFORMANCE_HINT``, ``NUM_STREAMS``...) are passed as given. An OpenVINO
    property this device lacks (another plugin's, such as ``GPU_HOST_TASK_PRIORITY`` on the
    CPU) is left out with a warning; a key in capitals that names no OpenVINO property (a
    misspelling) is InvalidArgumentError; other keys are ignored (they are meant for
    another backend).
    """
    supported = _supported_properties(core, ov_device)
    config: dict[str, Any] = {}
    precision = options.precision.strip().lower()
    if precision == "tf32":  # NVIDIA's TensorFloat-32: no OpenVINO mode, so f32
        precision = "f32"
    if precision not in ("", "default") and "INFERENCE_PRECISION_HINT" in supported:
        config["INFERENCE_PRECISION_HINT"] = precision
    if options.threads and "INFERENCE_NUM_THREADS" in supported:
        config["INFERENCE_NUM_THREADS"] = options.threads
    if not options.thread_pinning and "ENABLE_CPU_PINNING" in supported:
        config["ENABLE_CPU_PINNING"] = False  # unless extra says otherwise, below
    for key, value in options.extra.items():
        if key in _READ_ONLY:
            raise InvalidArgumentError(
                f"{NAME}: option {key!r} is a property {ov_device} reports, not one it is "
                f"given: expected one it reads ({', '.join(_settable(supported))})")
        if key in config and key in SET_FROM_OPTIONS:
            own = SET_FROM_OPTIONS[key]
            raise InvalidArgumentError(
                f"{NAME}: option {key!r} = {value!r:.40} and {own!r} both set it (to "
                f"{config[key]!r}): expected {own!r} alone")
        if key in supported:
            config[key] = value
        elif key in known_properties():
            log.warning("%s: option %s is not a property of %s: left out (it reads %s)",
                        NAME, key, ov_device, ", ".join(_settable(supported)))
        elif _PROPERTY_FORM.fullmatch(key):
            raise InvalidArgumentError(_unknown_property(key, ov_device, supported))
    return config


_PROPERTY_FORM = re.compile(r"[A-Z][A-Z0-9_]*")

@functools.cache
def _supported_properties(core: Any, ov_device: str) -> Any:
    """Each core's and device's SUPPORTED_PROPERTIES, asked once: OpenVINO (2026.4) keeps
    about 3 KB of native memory for good each time it is asked (54 MB in 18,000 asks).
    (A core hashes by identity and the cache keeps it alive: wasinn's backends share the
    process's one, see ``openvino._process_core``, so this holds one entry per device.)"""
    return core.get_property(ov_device, "SUPPORTED_PROPERTIES")


@functools.cache
def known_properties() -> frozenset[str]:
    """Every property name the installed OpenVINO declares, whatever the device: the
    name-returning functions of its property modules (``hint``, ``streams``,
    ``intel_gpu``...). Empty when this OpenVINO lays them out otherwise."""
    try:
        from openvino._pyopenvino import properties as root
    except ImportError:
        return frozenset()
    found: set[str] = set()
    pending: list[types.ModuleType] = [root]
    while pending:
        module = pending.pop()
        for attr in vars(module).values():
            if isinstance(attr, types.ModuleType):
                if attr.__name__.startswith(root.__name__ + "."):
                    pending.append(attr)
            elif isinstance(attr, types.BuiltinFunctionType):
                with contextlib.suppress(Exception):  # one that needs an argument
                    name = attr()
                    if isinstance(name, str):
                        found.add(name)
    return frozenset(found)


def _settable(supported: Sequence[str]) -> list[str]:
    return sorted(str(p) for p in supported if str(p) not in _READ_ONLY)


#: Properties a plugin reports but does not take at compile time.
_READ_ONLY = frozenset({
    "AVAILABLE_DEVICES", "DEVICE_ARCHITECTURE", "DEVICE_ID", "DEVICE_TYPE",
    "EXECUTION_DEVICES", "FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES",
    "RANGE_FOR_ASYNC_INFER_REQUESTS", "RANGE_FOR_STREAMS", "SUPPORTED_PROPERTIES",
})


def _unknown_property(key: str, ov_device: str, supported: Sequence[str]) -> str:
    settable = _settable(supported)
    close = difflib.get_close_matches(key, [*settable, *known_properties()], n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{NAME}: option {key!r} is not an OpenVINO property: {hint}expected one "
            f"{ov_device} reads ({', '.join(settable)})")
