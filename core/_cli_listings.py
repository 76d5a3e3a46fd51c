"""What ``wasinn devices`` and ``wasinn models`` print: the backends and devices a config
gives, and its model registry, as plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from wasinn.errors import WasiNNError

if TYPE_CHECKING:
    from wasinn.backends.registry import BackendRegistry
    from wasinn.configs.schema import ModelConfig, PipelineConfig, RuntimeConfig


async def print_devices(config: RuntimeConfig) -> None:
    """Print the backends ``config`` names (installed or not, their devices and encodings),
    then the devices a runtime on ``config`` serves and the backends each runs.

    The runtime is started without ``config``'s models and pipelines: the devices do not
    depend on them, and a preload that cannot load (a model file not there yet) must not
    hide the device table, nor a heavy one make the listing as slow as a start. Raises
    what starting the runtime raises (a WasiNNError for a pool that cannot be served).

    Cancellation (Ctrl-C) stops it at once, also while the backends are probed: that
    probe (importing torch or OpenVINO takes seconds) runs in a worker thread, which is
    abandoned (:mod:`wasinn._abandoned`); it only imports and asks, and writes nothing.
    """
    from wasinn._abandoned import run_abandonable
    from wasinn.backends.registry import BackendRegistry
    from wasinn.scheduler import Runtime

    registry = BackendRegistry(config.runtime.backends or ())
    rows, found = await run_abandonable(_probe_backends, registry)
    print(table(("BACKEND", "STATUS", "DEVICES", "ENCODINGS"), rows))
    print()
    devices_only = config.model_copy(update={"models": {}, "pipelines": {}})
    async with Runtime(devices_only) as rt:
        served = [(d.name, d.kind.value, ", ".join(found.get(d.name, [])) or "-")
                  for d in rt.devices]
    print(table(("DEVICE", "KIND", "BACKENDS"), served))


def _probe_backends(registry: BackendRegistry
                    ) -> tuple[list[tuple[str, ...]], dict[str, list[str]]]:
    """The backends table's rows for ``registry``'s backends (installed or not, their
    devices and encodings), and the backends found for each device name."""
    rows: list[tuple[str, ...]] = []
    found: dict[str, list[str]] = {}
    for name in registry.names():
        if not registry.is_installed(name):
            rows.append((name, "not installed", "-", "-"))
            continue
        try:
            backend = registry.get(name)
            devices = [d.name for d in backend.devices()]
        except WasiNNError as exc:
            rows.append((name, "unavailable", "-", exc.message))
            continue
        encodings = ", ".join(sorted(e.value for e in backend.encodings))
        rows.append((name, "installed", ", ".join(devices) or "-", encodings))
        for device in devices:
            found.setdefault(device, []).append(name)
    return rows, found


def print_models(config: RuntimeConfig, where: str) -> None:
    """Print ``config``'s models and pipelines: encoding, target, when each is loaded,
    its batching and its files or steps; or, where it has none, that ``where`` (the config
    file, in words) registers none and how to add one."""
    rows: list[tuple[str, ...]] = [
        (name, "model", m.encoding, m.target, _loaded(m), _batching(m), ", ".join(m.files))
        for name, m in config.models.items()
    ]
    rows += [
        (name, "pipeline", "-", p.target, _loaded(p), _batching(p),
         " -> ".join(s.model for s in p.steps))
        for name, p in config.pipelines.items()
    ]
    if not rows:
        print(f"no models registered in {where}: add a [models] table, or give "
              "--nn-preload / --wasi nn-graph (to run, infer or models)")
        return
    print(table(("NAME", "KIND", "ENCODING", "TARGET", "LOADED", "BATCHING", "FILES / STEPS"),
                rows))


def _loaded(entry: ModelConfig | PipelineConfig) -> str:
    """When the runtime loads a registry entry, and for how long."""
    if entry.warmup:
        return f"at start, {entry.warmup} warm-up run(s)"
    if entry.preload:
        return "at start"
    return "first use, kept" if entry.kept else "first use"


def _batching(entry: ModelConfig | PipelineConfig) -> str:
    """How a registry entry's requests are batched, in a few words."""
    batching = entry.batching
    if batching is None:
        return "-"
    delay = f", waits {batching.max_delay_ms:g} ms" if batching.max_delay_ms else ""
    return f"up to {batching.max_batch}{delay}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``rows`` under ``header``, each column as wide as its widest cell, two spaces
    apart, with no trailing blanks."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)
