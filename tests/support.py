"""Shared test helpers: skipping what this machine lacks, unless WASINN_REQUIRE says it must run.

``WASINN_REQUIRE=gpu,openvino`` turns the skip for those features into a failure, so CI
or a GPU machine can insist that a path really ran.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from wasinn.actors import DeviceActor
from wasinn.backends.base import Device
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError


def required() -> set[str]:
    return {f.strip().lower() for f in os.environ.get("WASINN_REQUIRE", "").split(",") if f.strip()}


def skip_unless(feature: str, available: bool, reason: str) -> None:
    """Skip (or fail, where WASINN_REQUIRE names ``feature``) when ``available`` is false."""
    if available:
        return
    if feature.lower() in required():
        pytest.fail(f"WASINN_REQUIRE={feature} but {reason}")
    pytest.skip(reason)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def has_cuda() -> bool:
    if not has_module("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def require_backend(library: str) -> None:
    skip_unless(library, has_module(library), f"{library} is not installed")


def require_gpu() -> None:
    skip_unless("gpu", has_cuda(), "no CUDA GPU on this machine")


def cpu_pool(**pool: Any) -> RuntimeConfig:
    """A config with one pool: the CPU device, with ``pool``'s settings (workers, ...)."""
    return parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], **pool}}}, None)


async def closed_while_running(actor: DeviceActor, job: Callable[[], object]) -> None:
    """Run ``job`` on ``actor``, expecting the actor to close while it runs: its caller
    is told so at once, not when the job returns (a gated job ignores cancellation)."""
    with pytest.raises(ClosedResourceError, match="closed while the job ran"):
        await actor.execute(job)


@asynccontextmanager
async def serving_actor(**settings: Any) -> AsyncIterator[DeviceActor]:
    """A CPU :class:`DeviceActor` (``settings``: workers, queue_limit...), serving until
    the block ends."""
    async with trio.open_nursery() as nursery:
        yield await nursery.start(DeviceActor(Device(ExecutionTarget.CPU), **settings).serve)
        nursery.cancel_scope.cancel()


#: How a backend run ended, as :func:`recorded_runs` keeps it: None for one that
#: returned its outputs, or the exception it raised.
RunOutcome = BaseException | None


def recorded_runs(monkeypatch: pytest.MonkeyPatch) -> list[RunOutcome]:
    """Spy on every real backend run (``CheckedGraph.run``: ONNX Runtime, OpenVINO and
    PyTorch graphs, whichever thread runs them): each run's outcome is appended as it
    ends (a run still going is not there yet). The runs themselves are the library's."""
    from wasinn.backends._graphio import CheckedGraph

    outcomes: list[RunOutcome] = []
    run = CheckedGraph.run

    def spy(self: CheckedGraph, *args: Any, **kwargs: Any) -> Any:
        try:
            result = run(self, *args, **kwargs)
        except BaseException as exc:
            outcomes.append(exc)
            raise
        outcomes.append(None)
        return result

    monkeypatch.setattr(CheckedGraph, "run", spy)
    return outcomes


def cancelled_runs(outcomes: list[RunOutcome]) -> list[BaseException]:
    """The runs among ``outcomes`` that stopped because they were cancelled (the
    backend's BackendRuntimeError "run cancelled"), not because they ran to their end."""
    from wasinn.errors import BackendRuntimeError

    return [o for o in outcomes
            if isinstance(o, BackendRuntimeError) and "run cancelled" in o.message]


class LibraryInputs:
    """``with LibraryInputs(backend) as received:`` records what the library itself is
    handed as a run's inputs while the block runs, in order: the ``OrtValue`` s bound to
    ONNX Runtime's ``IOBinding``, the tensors set on an OpenVINO infer request, the
    tensor arguments of each torch module call."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.received: list[Any] = []
        self._patch = pytest.MonkeyPatch()
        self._undo: Callable[[], None] = lambda: None

    def __enter__(self) -> list[Any]:
        received = self.received
        if self.backend == "onnxruntime":
            from onnxruntime.capi.onnxruntime_inference_collection import IOBinding

            bind = IOBinding.bind_ortvalue_input

            def bind_spy(binding: Any, name: str, ortvalue: Any) -> Any:
                received.append(ortvalue)
                return bind(binding, name, ortvalue)

            self._patch.setattr(IOBinding, "bind_ortvalue_input", bind_spy)
        elif self.backend == "openvino":
            import openvino as ov

            set_input = ov.InferRequest.set_input_tensor

            def set_spy(request: Any, *args: Any) -> Any:
                received.append(args[-1])  # (tensor) or (index, tensor)
                return set_input(request, *args)

            self._patch.setattr(ov.InferRequest, "set_input_tensor", set_spy)
        elif self.backend == "pytorch":
            import torch

            def hook(_module: Any, args: tuple[Any, ...]) -> None:
                received.extend(a for a in args if isinstance(a, torch.Tensor))

            self._undo = torch.nn.modules.module.register_module_forward_pre_hook(hook).remove
        else:
            raise ValueError(f"no spy for backend {self.backend!r}")
        return received

    def __exit__(self, *exc_info: object) -> None:
        self._patch.undo()
        self._undo()


def passed_as_is(received: list[Any], native: Any) -> bool:
    """Whether every input in ``received`` (:class:`LibraryInputs`) is ``native`` itself:
    the same object (an ``OrtValue``, an ``ov.Tensor``), or for torch tensors the same
    memory; False when nothing was received."""
    if not received:
        return False
    if has_module("torch"):
        import torch

        if isinstance(native, torch.Tensor):
            return all(isinstance(r, torch.Tensor) and r.device == native.device
                       and r.data_ptr() == native.data_ptr() for r in received)
    return all(r is native for r in received)


def armed_cancellation() -> Any:
    """A real :class:`~wasinn.backends.base.Cancellation` whose ``armed`` event is set
    once a backend registers on it what interrupts its library (ONNX Runtime's terminate
    flag, OpenVINO's ``InferRequest.cancel``): the library call is about to start."""
    import threading

    from wasinn.backends.base import Cancellation

    class Armed(Cancellation):
        def __init__(self) -> None:
            super().__init__()
            self.armed = threading.Event()

        def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
            forget = super().on_cancel(callback)
            self.armed.set()
            return forget

    return Armed()
