"""Loading models into a runtime: a model compiled once when it is loaded, and the
config's registry entries loaded by name.

:class:`ModelLoading` is the part of :class:`~.runtime.Runtime` that loads. A model is
compiled once at load, on the device kind it targets (a pipeline step: on its pipeline's
device), so that bad bytes fail there and its inputs and outputs are known. A registry
model's files are read from disk, relative ones only from inside the config's directory
(SecurityError otherwise, NotFoundError for a file that cannot be read); a registry
pipeline holds its steps' models, loaded by name, wires them and compiles them on one
device of its kind. Every error of an entry names the config key that wrote it.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from wasinn.actors.batching import Batching, check_batchable, fit_batching
from wasinn.backends.base import LoadOptions
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import NotFoundError, SecurityError, WasiNNError
from wasinn.files import OutsideError, read_regular

from .model import Executable, LoadedModel
from .names import Entry, NameRegistry
from .pipeline import PipelineModel, check_chain_batchable, resolve_wiring

if TYPE_CHECKING:
    from wasinn.configs.schema import PipelineConfig, RuntimeConfig

    from .placement import Scheduler


class ModelLoading:
    """How a runtime loads models and its registry's entries (see the module docstring):
    the runtime's ``__init__`` sets what follows, and ``_sched`` is its scheduler."""

    _config: RuntimeConfig
    _names: NameRegistry

    if TYPE_CHECKING:
        @property
        def _sched(self) -> Scheduler: ...

    async def _load_model(self, builders: tuple[bytes, ...], encoding: GraphEncoding,
                          target: ExecutionTarget | str, *, backend: str | None,
                          options: LoadOptions, name: str, batching: Batching | None = None,
                          compile_on: ExecutionTarget | None = None
                          ) -> tuple[LoadedModel, ExecutionTarget]:
        # Compiled once now, on ``compile_on`` if given (a pipeline's device) else on the
        # resolved ``target``: its inputs and outputs are read there.
        scheduler = self._sched
        kind = scheduler.resolve_target(target) if compile_on is None else compile_on
        model = LoadedModel(builders, encoding, options, backend_name=backend, name=name,
                            batching=batching)
        model.runner = scheduler
        model.on_release = scheduler.release
        model.in_flight.changed = scheduler.runs_changed
        try:
            compiled = await scheduler.compile(model, kind)
            model.inputs, model.outputs = compiled.inputs, compiled.outputs
            model.input_aliases = compiled.input_aliases
            model.output_aliases = compiled.output_aliases
            if batching is not None:
                model.batch_major = check_batchable(model.name, model.inputs,
                                                    model.outputs, model.declared_dims())
                model.batching = fit_batching(model.name, batching, model.inputs)
        except BaseException:
            # Nobody holds it: leave nothing compiled, and no compile still under way
            # (this load was cancelled) cached for a model nobody can unload.
            scheduler.release(model)
            raise
        return model, kind

    async def _load_named(self, name: str, run_on: ExecutionTarget | None) -> Entry:
        from wasinn.configs.loader import model_file

        config = self._config
        pipeline = config.pipelines.get(name)
        if pipeline is not None:
            return await self._load_pipeline(name, pipeline)
        entry = config.models[name]
        try:
            paths = [model_file(config, f) for f in entry.files]
            # A relative file must still lie in the config directory once opened.
            base = config.base_dir.resolve()
            inside = [None if Path(f).is_absolute() else base for f in entry.files]
            builders = await trio.to_thread.run_sync(_read_files, paths, name, inside)
        except WasiNNError as exc:  # say which registry entry names it
            raise exc.prefixed(config.model_key(name)) from exc
        # The file the host read: where an ONNX model's external data may lie.
        options = LoadOptions(precision=entry.precision, threads=entry.threads,
                              extra=dict(entry.options), source=str(paths[0]),
                              sandbox=entry.sandbox,
                              max_sandbox_bytes=entry.max_sandbox_bytes)
        try:
            model, _ = await self._load_model(
                builders, GraphEncoding.coerce(entry.encoding), entry.target,
                backend=entry.backend, options=options, name=name,
                batching=entry.batching_spec(), compile_on=run_on)
        except WasiNNError as exc:  # say which registry entry would not load
            raise exc.prefixed(config.model_key(name)) from exc
        return model, entry.target

    async def _load_pipeline(self, name: str, pipeline: PipelineConfig) -> Entry:
        # Each step is held from the moment the registry hands it over, so that another
        # caller's load and unload of that model meanwhile cannot free it under us; if
        # anything fails (or the load is cancelled), the steps are let go again, which
        # frees those nobody else holds: a failed load leaves nothing compiled.
        scheduler = self._sched
        try:
            kind = scheduler.resolve_target(pipeline.target)
        except WasiNNError as exc:
            raise exc.prefixed(pipeline_key(self._config, name, "target")) from exc
        steps: list[LoadedModel] = []
        try:
            for i, step in enumerate(pipeline.steps):
                # Compiled on the pipeline's device, whatever the model's own target.
                try:
                    executable, _ = await self._names.get(step.model, run_on=kind)
                except WasiNNError as exc:
                    raise exc.prefixed(_step_key(self._config, name, i, kind)) from exc
                assert isinstance(executable, LoadedModel)
                executable.retain()  # no checkpoint since the registry returned it
                steps.append(executable)
            # Wiring first: its errors come before anything more is compiled.
            links = resolve_wiring(name, steps, [s.wire for s in pipeline.steps],
                                   functools.partial(_wire_key, self._config, name))
            batching = pipeline.batching_spec()
            if batching is not None:
                try:  # (before compiling anything more)
                    check_chain_batchable(name, steps, links)
                    for i, step_model in enumerate(steps):  # its rows pass every step
                        batching = fit_batching(
                            f"pipeline {name!r} step {i} ({step_model.name})", batching,
                            step_model.inputs)
                except WasiNNError as exc:
                    raise exc.prefixed(pipeline_key(self._config, name, "batching")
                                       ) from exc
            # Compile every step on one device of the kind now, so errors surface at load.
            actor = scheduler.pick(kind, {})
            for i, step_model in enumerate(steps):
                try:
                    await scheduler.session(actor, step_model)
                except WasiNNError as exc:
                    raise exc.prefixed(_step_key(self._config, name, i, kind)) from exc
            made: Executable = PipelineModel(name, steps, links, scheduler, batching=batching)
        finally:
            # PipelineModel holds the steps itself now (or nothing does): let ours go.
            for step_model in steps:
                step_model.release()
        return made, pipeline.target


def _read_files(paths: Sequence[Path], name: str, inside: Sequence[Path | None]
                ) -> tuple[bytes, ...]:
    # ``inside``: for each path, the directory the file opened must lie in, or None.
    out = []
    for path, folder in zip(paths, inside, strict=True):
        try:  # (a FIFO or a device would block the load)
            out.append(read_regular(path, inside=folder))
        except OutsideError as exc:
            raise SecurityError(f"model {name!r}: its file {str(path)!r}: {exc.strerror}"
                                ) from None
        except OSError as exc:
            raise NotFoundError(
                f"model {name!r} is registered but its file {str(path)!r} cannot be read: "
                f"{exc.strerror or exc}" + (": expected a model file"
                                            if exc.errno in (errno.EINVAL, errno.EISDIR)
                                            else "")
            ) from None
    return tuple(out)


def _step_key(config: RuntimeConfig, pipeline: str, index: int, kind: ExecutionTarget
              ) -> str:
    # Where a pipeline's step is written, and the device kind it runs on, for its errors.
    model = config.pipelines[pipeline].steps[index].model
    return (f"{pipeline_key(config, pipeline, f'steps[{index}]')} (model {model!r}, on "
            f"the pipeline's {kind.value} device)")


def pipeline_key(config: RuntimeConfig, pipeline: str, key: str) -> str:
    # Where a pipeline's ``key`` is written, for the errors it causes.
    from wasinn.configs._values import key_name

    return config.where(f"pipelines.{key_name(pipeline)}.{key}")


def _wire_key(config: RuntimeConfig, pipeline: str, step: int) -> str:
    # Where a pipeline step's wire is written, for resolve_wiring's errors.
    return pipeline_key(config, pipeline, f"steps[{step}].wire")
