"""The runtime's device actors and backend registries, made from its config's pools.

Each ``[pools.NAME]`` table gives a kind of device, the backends to ask in order of
preference, and the devices to use (``"auto"``: every one a backend reports). The CPU
pool has the one CPU device; another pool's devices are those its backends report (asking
may import their libraries: :func:`plan_pools` runs in a worker thread). A configured
device no backend reports is an UnsupportedOperationError naming the config's key; a pool
that finds no device is logged as a warning (logger ``wasinn.scheduler``) and has no
actor, and no registry in the runtime's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from wasinn.actors.device import DeviceActor
from wasinn.actors.queue import policy_for
from wasinn.backends.base import Backend, Device
from wasinn.backends.registry import DEFAULT_PREFERENCE, BackendRegistry
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError, UnsupportedOperationError, WasiNNError

if TYPE_CHECKING:
    from wasinn.configs.schema import PoolConfig, RuntimeConfig

log = logging.getLogger("wasinn.scheduler")


def plan_pools(config: RuntimeConfig, extra: tuple[Backend, ...]
               ) -> tuple[list[DeviceActor], dict[ExecutionTarget, BackendRegistry]]:
    """One actor per device of each pool of ``config``, and each kind's registry of
    backends (with the ``extra`` instances), for the kinds where a pool found a device."""
    # Runs in a worker thread: asking backends for devices may import their libraries.
    from wasinn.configs import ConfigError
    from wasinn.configs._values import key_name

    actors: list[DeviceActor] = []
    registries: dict[ExecutionTarget, BackendRegistry] = {}
    for pool_name, pool in config.pools.items():
        kind = ExecutionTarget.coerce(pool.kind)
        preference = pool.backends or config.runtime.backends or DEFAULT_PREFERENCE
        try:
            registry = BackendRegistry(preference, extra=extra)
        except InvalidArgumentError as exc:
            # Checked when the runtime was made; kept for a config changed since.
            key = (f"pools.{pool_name}.backends" if pool.backends
                   else "runtime.backends")
            raise ConfigError(f"{config.source or '<config>'}: {key}: {exc.message}"
                              ) from None
        devices = _pool_devices(config, pool_name, pool, kind, registry)
        if devices:
            registries[kind] = registry
        else:
            # Not an error (a config may list pools for hardware some hosts lack),
            # but a runtime whose only pool found nothing cannot run anything: say so.
            asked = ", ".join(n for n in (pool.backends or registry.installed())
                              if registry.is_installed(n)) or "none installed"
            fallback = config.runtime.fallback
            then = (f"{kind.value} targets fall back to {fallback}"
                    if fallback and fallback != kind.value
                    else f"{kind.value} targets get unsupported-operation")
            log.warning("pool %s (kind %s): no device found (backends asked: %s); "
                        "the pool has no actor, %s", pool_name, kind.value, asked, then)
        actors += [DeviceActor(d, workers=pool.workers, queue_limit=pool.queue_limit,
                               policy=policy_for(pool.policy, config.tenant_weights),
                               inline_below=pool.inline_below_us * 1e-6,
                               close_timeout=pool.close_timeout,
                               pin_handoffs=pool.pin_handoffs,
                               compile_threads=pool.compile_threads,
                               pool=f"[pools.{key_name(pool_name)}]")
                   for d in devices]
    if not actors:
        log.warning("no pool found a device: this runtime can run no model (pools: %s)",
                    ", ".join(config.pools) or "none")
    return actors, registries


def _pool_devices(config: RuntimeConfig, pool_name: str, pool: PoolConfig,
                  kind: ExecutionTarget, registry: BackendRegistry) -> list[Device]:
    if kind is ExecutionTarget.CPU:
        return [Device(ExecutionTarget.CPU)]  # every backend runs on the CPU
    names = [n for n in (pool.backends or registry.installed()) if registry.is_installed(n)]
    reported: set[Device] = set()
    for name in names:
        try:
            reported.update(d for d in registry.get(name).devices() if d.kind is kind)
        except WasiNNError as exc:
            log.warning("pool %s: backend %s cannot list devices: %s", pool_name, name, exc)
    if pool.devices == "auto":
        return sorted(reported)
    wanted = [Device.parse(n) for n in pool.devices]
    for i, device in enumerate(wanted):
        if device not in reported:
            found = ", ".join(d.name for d in sorted(reported)) or "none"
            raise UnsupportedOperationError(
                f"{config.source or '<config>'}: pools.{pool_name}.devices[{i}]: "
                f"device {device} is not reported by any backend "
                f"({', '.join(names) or 'none installed'}); found: {found}"
            )
    return wanted
