"""Per-guest resource limits, set by config, enforced by both guest ABIs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuestLimits:
    """What one guest instance may hold at once. Beyond a limit the guest gets too-large.

    ``max_graphs``/``max_contexts``: live handles; ``max_model_bytes``: total bytes of
    model builders loaded by this guest; ``max_tensor_bytes``: the size of one tensor.
    """

    max_graphs: int = 64
    max_contexts: int = 1024
    max_model_bytes: int = 2 * 1024**3
    max_tensor_bytes: int = 1024**3


def limits_of(runtime: object) -> GuestLimits:
    """The guest limits a runtime's config sets (its ``[guests]`` table), else the defaults.

    Reads ``runtime.config.guests`` when the config schema has that section, taking any of
    the field names of :class:`GuestLimits` it defines.
    """
    section = getattr(getattr(runtime, "config", None), "guests", None)
    if section is None:
        return GuestLimits()
    names = GuestLimits.__dataclass_fields__
    values = {k: int(getattr(section, k)) for k in names if getattr(section, k, None) is not None}
    return GuestLimits(**values)
