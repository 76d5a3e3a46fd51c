"""Shared test helpers: skipping what this machine lacks, unless WASINN_REQUIRE says it must run.

``WASINN_REQUIRE=gpu,openvino`` turns the skip for those features into a failure, so CI
or a GPU machine can insist that a path really ran. ``gpu`` is a CUDA GPU as the backend
under test sees it (torch's for PyTorch tests, the CUDA driver's for ONNX Runtime's);
``onnxruntime-gpu`` insists on ONNX Runtime's CUDA provider, so a GPU machine that should
run the ONNX Runtime CUDA tests sets ``WASINN_REQUIRE=gpu,onnxruntime-gpu``.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from wasinn.actors import DeviceActor
from wasinn.backends.base import Device, current_cancellation
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError
from wasinn.modelgen import affine_onnx


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


def has_ort_cuda_provider() -> bool:
    """Whether ONNX Runtime is installed with its CUDA provider (``onnxruntime-gpu``);
    it is listed on machines without a GPU too."""
    if not has_module("onnxruntime"):
        return False
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def require_ort_gpu(backend: Any) -> None:
    """Skip (or fail, under WASINN_REQUIRE) unless ONNX Runtime can run on a CUDA GPU
    here: its CUDA provider first (``onnxruntime-gpu``), then a ``gpu`` device that
    ``backend`` (an OnnxRuntimeBackend) reports, which the CUDA driver must see. Asks
    nothing of torch."""
    skip_unless("onnxruntime-gpu", has_ort_cuda_provider(),
                "onnxruntime has no CUDA provider here (install onnxruntime-gpu)")
    skip_unless("gpu", any(d.kind is ExecutionTarget.GPU for d in backend.devices()),
                "no CUDA GPU on this machine (the CUDA driver reports none)")


def cpu_pool(**pool: Any) -> RuntimeConfig:
    """A config with one pool: the CPU device, with ``pool``'s settings (workers, ...)."""
    return parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], **pool}}}, None)


def sandbox_children() -> list[psutil.Process]:
    """This process's sandbox processes (their command line names
    ``wasinn.backends._sandbox_child``: the code of ``CHILD_START`` for a graph's, of
    ``SPARE_START`` for a spare's), one started a moment ago included: right after its
    exec a process shows an empty command line for a while, which is read again here
    (for up to 5 s)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        deadline = time.monotonic() + 5
        while not (cmdline := child.cmdline()) and time.monotonic() < deadline:
            time.sleep(0.005)
        if "wasinn.backends._sandbox_child" in " ".join(cmdline):
            found.append(child)
    return found


def no_spares(config: RuntimeConfig) -> RuntimeConfig:
    """``config`` with ``[runtime] sandbox_spares = 0``: every sandbox process there is
    serves a graph, for tests that count them."""
    runtime = config.runtime.model_copy(update={"sandbox_spares": 0})
    return config.model_copy(update={"runtime": runtime})


def in_process_guests(config: RuntimeConfig) -> RuntimeConfig:
    """``config`` with ``[guests] sandbox = false``: the models guests load from their own
    bytes run in this process, where a test can watch their runs."""
    guests = config.guests.model_copy(update={"sandbox": False})
    return config.model_copy(update={"guests": guests})


def gate_job(gate: threading.Event, started: threading.Event | None = None,
             result: object = "gated") -> Callable[[], object]:
    def job() -> object:
        if started is not None:
            started.set()
        if not gate.wait(timeout=30):
            raise RuntimeError("gate never opened")
        return result
    return job


def until_cancelled(started: threading.Event, timeout: float = 30) -> bool:
    """In a job: set ``started``, then wait until the job's cancellation is cancelled
    (True) or ``timeout`` passes (False)."""
    cancellation = current_cancellation()
    assert cancellation is not None, "a worker thread's job runs under a cancellation"
    stop = threading.Event()
    cancellation.on_cancel(stop.set)
    started.set()
    return stop.wait(timeout)


def cooperative_job(started: threading.Event, log: list[str]) -> Callable[[], str]:
    """A job that runs until its cancellation is cancelled (as an ORT run would)."""
    def job() -> str:
        log.append("stopped" if until_cancelled(started) else "ran out")
        raise RuntimeError("interrupted")

    return job


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


#: The imports of :func:`core_nn_guest_wat` (WAT, each on a line of its own): the legacy
#: ``load``, ``init_execution_context`` (``$init``), ``set_input`` (``$set``), ``compute``
#: and WASI's ``proc_exit`` (``$exit``).
CORE_NN_IMPORTS = """
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context"
    (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))"""


def core_nn_guest_wat(memory: bytes, model: bytes, body: str, locals_: str = "") -> str:
    """A core-module guest (WAT) importing the legacy ``load``, ``init_execution_context``,
    ``set_input`` (``$set``), ``compute`` and ``proc_exit`` (``$exit``). Its memory holds
    ``memory`` from address 0, except the graph builder it writes at 0 (``model``, which
    lies at 4096); the graph's handle goes to 64 and the context's to 68. Its ``_start``
    loads the model (ONNX, CPU) and makes a context, in the local ``$ctx``, exiting with
    100 + the error or 200 + the error where either fails; then runs ``body`` (with the
    locals ``$e``, ``$ctx`` and ``locals_``)."""
    memory = struct.pack("<2I", 4096, len(model)) + bytes(memory[8:])
    data = "".join(f"\\{b:02x}" for b in memory)
    esc = "".join(f"\\{b:02x}" for b in model)
    return f"""(module{CORE_NN_IMPORTS}
  (memory (export "memory") 2)
  (data (i32.const 0) "{data}")
  (data (i32.const 4096) "{esc}")
  (func (export "_start") (local $e i32) (local $ctx i32) {locals_}
    (local.set $e (call $load (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 0)
                              (i32.const 64)))
    (if (local.get $e) (then (call $exit (i32.add (i32.const 100) (local.get $e)))))
    (local.set $e (call $init (i32.load (i32.const 64)) (i32.const 68)))
    (if (local.get $e) (then (call $exit (i32.add (i32.const 200) (local.get $e)))))
    (local.set $ctx (i32.load (i32.const 68)))
    {body}))"""


def affine_pipeline_config(tmp_path: Path) -> Path:
    """A config file in ``tmp_path``: one CPU pool of one worker, registry models ``a``
    (``2 x + 1``) and ``b`` (``3 x``), and pipeline ``p``: a, then b (a's ``y`` into b's
    ``x``)."""
    (tmp_path / "a.onnx").write_bytes(affine_onnx(2.0, 1.0))
    (tmp_path / "b.onnx").write_bytes(affine_onnx(3.0, 0.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 1\n\n'
                    '[models.a]\nfiles = ["a.onnx"]\nencoding = "onnx"\n\n'
                    '[models.b]\nfiles = ["b.onnx"]\nencoding = "onnx"\n\n'
                    '[pipelines.p]\nsteps = [{ model = "a" }, '
                    '{ model = "b", wire = { y = "x" } }]\n')
    return path


@asynccontextmanager
async def sandboxed_affine_children(tmp_path: Path, runtime_keys: str
                                    ) -> AsyncIterator[list[psutil.Process]]:
    """A runtime from a config file in ``tmp_path`` (``runtime_keys``, TOML lines of its
    ``[runtime]`` table; a CPU pool of ONNX Runtime; registry model ``affine``, ``2 x +
    1``, with ``sandbox = true``) that has computed ``affine`` once, checked; yields its
    sandbox processes, the graph's and the spare started after it. None is left after."""
    import numpy as np

    import wasinn

    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    config = tmp_path / "wasinn.toml"
    config.write_text(f"[runtime]\n{runtime_keys}"
                      '[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\n'
                      'backends = ["onnxruntime"]\n'
                      '[models.affine]\nfiles = ["affine.onnx"]\nsandbox = true\n')
    async with wasinn.Runtime.from_config(config) as rt:
        graph = await rt.load_by_name("affine")
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        children = sandbox_children()
        assert len(children) == 2  # the graph's process and the spare started after it
        yield children
    assert sandbox_children() == []
