"""Core-module guests end to end: real wasm (WAT and C), real threads, real backends."""

from __future__ import annotations

import functools
import gc
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import trio
import trio.testing

import wasinn
from tests.guest_support import WAT_DIR, GuestModels, example_guest, make_guest_models, top1
from tests.loopwatch import Heartbeat, heartbeat  # noqa: F401 - fixture
from tests.support import recorded_runs, require_backend
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import GuestTrap, run_wasm
from wasinn.modelgen import ModelFiles


@pytest.fixture(scope="session")
def guest_models(tmp_path_factory: pytest.TempPathFactory,
                 small_mobilenet: ModelFiles) -> GuestModels:
    return make_guest_models(tmp_path_factory.mktemp("guest-models"), small_mobilenet)


@pytest.fixture(scope="session")
def guest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("guests")


@pytest.fixture
async def rt(guest_models: GuestModels):  # type: ignore[no-untyped-def]
    require_backend("onnxruntime")
    async with wasinn.Runtime(guest_models.config) as runtime:
        yield runtime


def native_top1(guest_models: GuestModels) -> tuple[int, float]:
    session = ort.InferenceSession(str(guest_models.directory / "model.onnx"))
    return top1(session.run(None, {"input": guest_models.image})[0])


def printed(out: str, label: str) -> tuple[int, float]:
    match = re.search(rf"{label}: class (\d+) score (-?[\d.]+)", out)
    assert match, f"no '{label}' line in guest output {out!r}"
    return int(match[1]), float(match[2])


@pytest.mark.parametrize("name", ["bad_inputs", "old_types", "extensions", "rebind", "grow",
                                  "bound_dynamic"])
async def test_wat_guest_checks(rt: wasinn.Runtime, name: str) -> None:
    code = await rt.run_wasm(WAT_DIR / f"{name}.wat")
    assert code == 0, f"{name}.wat: check #{code} failed (see the `;; #{code}` comment)"


# bound_dynamic.wat: before, a bound buffer that a dynamic output outgrew got no size (a
# first compute) or the last successful compute's (16 bytes, which fit: a guest growing
# its buffer to it never got its output), on both paths.
@pytest.mark.parametrize("name", ["old_types", "extensions", "bound_dynamic"])
async def test_wat_guest_checks_with_a_compute_timeout(rt: wasinn.Runtime, name: str) -> None:
    # With a timeout the compute runs abandonably in a device worker, on copies of the
    # inputs and into host buffers copied to the guest after: same answers, bound outputs
    # included.
    code = await run_wasm(rt, WAT_DIR / f"{name}.wat", limits=GuestLimits(compute_timeout=60))
    assert code == 0, f"{name}.wat: check #{code} failed (see the `;; #{code}` comment)"


@pytest.mark.parametrize("sandbox", [False, True], ids=["in-process", "sandboxed"])
@pytest.mark.parametrize("timeout", [None, 60.0], ids=["inline", "compute-timeout"])
async def test_a_torchscript_model_takes_any_element_type_from_a_guest(
        tmp_path: Path, sandbox: bool, timeout: float | None) -> None:
    # TorchScript declares no element types: its specs' f32 is a placeholder. Before,
    # set_input checked it as the model's type and refused i64 and u8 tensors
    # (invalid_argument: "the model expects x: f32[...]"), which Graph.compute takes.
    require_backend("torch")
    import torch

    from tests.backend_models import scripted

    class AddOne(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    (tmp_path / "add_one.pt").write_bytes(scripted(AddOne()))
    config = parse_config({"models": {"add_one_ts": {
        "files": [str(tmp_path / "add_one.pt")], "encoding": "pytorch", "sandbox": sandbox}}},
        None, label="torchscript guest config")
    async with wasinn.Runtime(config) as runtime:
        code = await run_wasm(runtime, WAT_DIR / "torchscript_types.wat",
                              limits=GuestLimits(compute_timeout=timeout))
    assert code == 0, f"torchscript_types.wat: check #{code} failed"


async def test_a_buffer_refilled_for_each_input_is_read_at_compute_and_logged(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    # Inputs are views read at compute (no copy at set_input): both inputs read the
    # buffer's last data, as documented, and the host says so in its log.
    with caplog.at_level(logging.WARNING, logger="wasinn.host"):
        code = await rt.run_wasm(WAT_DIR / "reused_buffer.wat")
    assert code == 0  # 1 - 1; a host that copies at set_input would give 100 - 1
    (warning,) = [r for r in caplog.records if "overlapping guest bytes" in r.message]
    assert "'a', 'b'" in warning.message


async def test_guest_without_memory_gets_missing_memory(rt: wasinn.Runtime) -> None:
    assert await rt.run_wasm(WAT_DIR / "no_memory.wat") == 0


async def test_exit_code_is_returned(rt: wasinn.Runtime) -> None:
    assert await rt.run_wasm(WAT_DIR / "exit_code.wat") == 42


async def test_trap_raises_with_its_message(rt: wasinn.Runtime) -> None:
    with pytest.raises(GuestTrap, match="unreachable"):
        await rt.run_wasm(WAT_DIR / "trap.wat")


async def test_a_start_function_exit_is_the_guests_exit(rt: wasinn.Runtime) -> None:
    # (start) runs while the module is instantiated: its exit is no instantiation error.
    assert await rt.run_wasm(WAT_DIR / "start_exit.wat") == 7


@pytest.mark.parametrize(("exports", "said"), [
    ('(func (export "_initialize")) (func (export "_start"))',
     "both.wat exports both _start and _initialize: expected a WASI command (_start) or a "
     "reactor (_initialize), not both, as Wasmtime does"),
    ('(func (export "_initialize"))',
     "both.wat exports no _start function (it exports _initialize: a reactor): expected a "
     "WASI command module"),
])
async def test_a_module_is_a_command_not_a_reactor(
        rt: wasinn.Runtime, tmp_path: Path, exports: str, said: str) -> None:
    # Wasmtime refuses a module that exports both ("Program cannot be both a Command and
    # a Reactor"): each runs its constructors, which running both would run twice.
    guest = tmp_path / "both.wat"
    guest.write_text(f'(module (memory (export "memory") 1) {exports})')
    with pytest.raises(wasinn.InvalidArgumentError) as caught:
        await rt.run_wasm(guest)
    assert caught.value.message.startswith(said), caught.value.message


async def test_a_start_function_trap_is_a_guest_trap(rt: wasinn.Runtime) -> None:
    # Not a raw wasmtime Trap; and the graph it loaded there is let go.
    with pytest.raises(GuestTrap, match=r"(?s)start_trap.wat trapped: .*unreachable"):
        await rt.run_wasm(WAT_DIR / "start_trap.wat")
    (identity,) = rt.name_registry.loaded()  # loaded by the start function...
    assert identity.released  # ...and let go with the guest


async def test_not_a_module_is_an_invalid_argument(rt: wasinn.Runtime, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.wasm"
    bogus.write_bytes(b"\0asm\x01\0\0\0garbage")
    with pytest.raises(wasinn.InvalidArgumentError, match="not a valid WebAssembly module"):
        await rt.run_wasm(bogus)
    # Neither a binary nor text (a model given in the guest's place): not wasmtime's
    # complaint that it is no UTF-8 text, but what was expected.
    model = tmp_path / "model.onnx"
    model.write_bytes(b"\x08\x08\x12\x0f\xff")
    with pytest.raises(wasinn.InvalidArgumentError,
                       match=r"^model.onnx is not a valid WebAssembly module: expected a .wasm "
                             r"binary \(starting with \\0asm; this starts with "
                             r"b'\\x08\\x08\\x12\\x0f'\) or WebAssembly text \(.wat\)$"):
        await rt.run_wasm(model)


async def test_cancelling_one_guest_interrupts_only_that_guest(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wasinn.host")
    spin = WAT_DIR / "spin.wat"
    first, second = trio.CancelScope(), trio.CancelScope()
    finished: list[str] = []

    async def guest(scope: trio.CancelScope, label: str) -> None:
        with scope:
            await rt.run_wasm(spin)
        finished.append(label)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest, first, "first")
        nursery.start_soon(guest, second, "second")
        with trio.fail_after(30):  # both are instantiated: their _start is called next
            while sum(r.getMessage().startswith("instantiated spin.wat")
                      for r in caplog.records) < 2:
                await trio.sleep(0.01)
        first.cancel()
        with trio.fail_after(30):
            while not finished:
                await trio.sleep(0.01)
        assert finished == ["first"]
        await trio.sleep(0.3)  # the other guest's store saw the epoch move and carried on
        assert finished == ["first"]
        second.cancel()
    assert first.cancelled_caught
    assert second.cancelled_caught


async def test_c_classifier_loads_from_files(rt: wasinn.Runtime, guest_models: GuestModels,
                                             guest_dir: Path,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    wasm = example_guest("classify", guest_dir)
    code = await rt.run_wasm(wasm, argv=["/data/model.onnx", "/data/input.bin", "1"],
                             dirs={"/data": str(guest_models.directory)})
    assert code == 0
    cls, score = printed(capfd.readouterr().out, "top-1")
    want_cls, want_score = native_top1(guest_models)
    assert cls == want_cls
    assert score == pytest.approx(want_score, abs=1e-4)


@pytest.mark.parametrize("flags", [[], ["--legacy"]], ids=["wasinn-extensions", "legacy"])
async def test_c_classifier_by_name(rt: wasinn.Runtime, guest_models: GuestModels,
                                    guest_dir: Path, capfd: pytest.CaptureFixture[str],
                                    flags: list[str]) -> None:
    wasm = example_guest("classify_named", guest_dir)
    code = await rt.run_wasm(wasm, argv=[*flags, "--repeat", "3", "mobilenet", "/d/input.bin"],
                             dirs={"/d": str(guest_models.directory)})
    assert code == 0
    cls, score = printed(capfd.readouterr().out, "top-1")
    want_cls, want_score = native_top1(guest_models)
    assert (cls, pytest.approx(want_score, abs=1e-4)) == (want_cls, score)


async def test_c_guest_chains_two_models(rt: wasinn.Runtime, guest_models: GuestModels,
                                         guest_dir: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    wasm = example_guest("chain", guest_dir)
    code = await rt.run_wasm(wasm, argv=["mobilenet", "affine", "/d/input.bin"],
                             dirs={"/d": str(guest_models.directory)})
    assert code == 0
    out = capfd.readouterr().out
    first_cls, first_score = printed(out, "first")
    second_cls, second_score = printed(out, "second")
    assert first_cls == second_cls == native_top1(guest_models)[0]
    assert second_score == pytest.approx(2 * first_score + 1, abs=1e-3)  # affine: 2x + 1


async def test_many_guests_share_one_loaded_graph(rt: wasinn.Runtime, guest_models: GuestModels,
                                                  guest_dir: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    wasm = example_guest("classify_named", guest_dir)
    codes: list[int] = []
    gate = trio.Event()

    async def guest() -> None:
        await gate.wait()
        codes.append(await rt.run_wasm(wasm, argv=["--repeat", "5", "mobilenet", "/d/input.bin"],
                                       dirs={"/d": str(guest_models.directory)}))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(guest)
        gate.set()
    assert codes == [0, 0, 0, 0]
    tops = re.findall(r"top-1: class (\d+)", capfd.readouterr().out)
    assert tops == [str(native_top1(guest_models)[0])] * 4
    assert rt.name_registry.loads["mobilenet"] == 1  # loaded once, shared by all four


async def test_cancel_during_inference_releases_graphs(rt: wasinn.Runtime,
                                                       guest_models: GuestModels,
                                                       guest_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    wasm = example_guest("classify_named", guest_dir)
    runs = recorded_runs(monkeypatch)
    scope = trio.CancelScope()

    async def guest() -> None:
        with scope:
            await rt.run_wasm(wasm, argv=["--repeat", "1000000", "mobilenet", "/d/input.bin"],
                              dirs={"/d": str(guest_models.directory)})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest)
        with trio.fail_after(60):  # the guest loaded the model and is running inferences
            while not (rt.name_registry.loads.get("mobilenet") and runs):
                await trio.sleep(0.01)
        scope.cancel()
    assert scope.cancelled_caught
    assert rt.name_registry.loads["mobilenet"] == 1
    graph = await rt.load_by_name("mobilenet")
    # The cancelled guest's graph and context were released, so the registry had dropped
    # the model and loaded it again for this caller.
    assert rt.name_registry.loads["mobilenet"] == 2
    out = await graph.compute({"input": guest_models.image})
    assert np.isfinite(next(iter(out.values())).numpy()).all()
    await graph.unload()


async def test_guest_limits(rt: wasinn.Runtime) -> None:
    limits = GuestLimits(max_graphs=1, max_contexts=1, max_model_bytes=10, max_tensor_bytes=8)
    code = await run_wasm(rt, WAT_DIR / "limits.wat", limits=limits)
    assert code == 0, f"limits.wat: check #{code} failed"


async def test_edge_case_guests_in_parallel_keep_their_own_errors(rt: wasinn.Runtime) -> None:
    # Three guests returning many different errnos at once, each in its own thread: no
    # error is attributed to the wrong guest and no guest disturbs another.
    codes: dict[str, int] = {}

    async def guest(name: str) -> None:
        codes[name] = await rt.run_wasm(WAT_DIR / f"{name}.wat")

    async with trio.open_nursery() as nursery:
        for name in ("bad_inputs", "extensions", "old_types", "bad_inputs"):
            nursery.start_soon(guest, name)
    assert codes == {"bad_inputs": 0, "extensions": 0, "old_types": 0}


async def test_guest_never_blocks_the_event_loop(
        rt: wasinn.Runtime, guest_models: GuestModels, guest_dir: Path,
        heartbeat: Heartbeat) -> None:  # noqa: F811 - the imported fixture
    wasm = example_guest("classify_named", guest_dir)
    # Loaded beforehand: creating a backend session holds the GIL for a while in its
    # worker thread, which is the backend's cost, not the guest's.
    graph = await rt.load_by_name("mobilenet")
    # A full garbage collection of this test process (~300,000 objects: 80-120 ms) holds
    # the GIL, hence the loop, whoever triggers it; earlier tests' garbage can make one due
    # now. That pause is CPython's, not the guest's: collect and freeze what exists first.
    gc.collect()
    gc.freeze()
    heartbeat.reset()
    start = time.perf_counter()
    try:
        code = await rt.run_wasm(wasm, argv=["--repeat", "20", "mobilenet", "/d/input.bin"],
                                 dirs={"/d": str(guest_models.directory)})
    finally:
        gc.unfreeze()
    elapsed = time.perf_counter() - start
    assert code == 0
    assert heartbeat.beats > 0
    # wasm, model loading and inference all run off the loop: no gap near the run time
    assert heartbeat.max_gap < elapsed / 4, (heartbeat.max_gap, elapsed)
    await graph.unload()


@pytest.mark.parametrize(("timeout", "in_workers"), [(None, 0), (60.0, 4)],
                         ids=["guest-thread", "worker-thread-for-timeouts"])
async def test_guest_computes_run_in_the_guest_thread_unless_a_timeout_applies(
        rt: wasinn.Runtime, guest_models: GuestModels, guest_dir: Path,
        capfd: pytest.CaptureFixture[str], timeout: float | None, in_workers: int) -> None:
    # Without a compute timeout the guest's own thread runs the backend once it holds a
    # device slot (no hand-off to the actor's worker thread); with one, each compute runs
    # in the worker thread so that it can be abandoned when the timeout passes.
    wasm = example_guest("classify_named", guest_dir)
    graph = await rt.load_by_name("mobilenet")  # compiled (in the compile thread) first
    (cpu,) = rt.actors
    finished, completed = cpu.threads.finished, cpu.completed
    code = await run_wasm(rt, wasm, argv=["--repeat", "4", "mobilenet", "/d/input.bin"],
                          dirs={"/d": str(guest_models.directory)},
                          limits=GuestLimits(compute_timeout=timeout))
    assert code == 0
    assert printed(capfd.readouterr().out, "top-1")[0] == native_top1(guest_models)[0]
    assert cpu.completed - completed == 4  # four runs, each holding the device's slot
    assert cpu.threads.finished - finished == in_workers
    assert cpu.load == 0
    await graph.unload()


def batched_mobilenet(guest_models: GuestModels, batching: bool = True) -> RuntimeConfig:
    """One worker on the CPU, and the MobileNet model batching up to 8 rows (or not)."""
    model: dict[str, object] = {"files": [str(guest_models.directory / "model.onnx")],
                                "encoding": "onnx"}
    if batching:
        model["batching"] = {"max_batch": 8}
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {"mobilenet": model},
    }, None)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_guest_cancelled_while_its_request_runs_in_a_worker_leaves_it_safe_inputs(
        guest_models: GuestModels, guest_dir: Path, batching: bool) -> None:
    # A guest's compute on a busy device runs in a worker thread (in a batch, or alone,
    # started by the thread that frees the slot). A cancelled guest leaves it at once and
    # its Store (its linear memory) is freed while the run goes on: the run must hold
    # copies, not views of that memory (which would be read after it was unmapped: a
    # crash of the whole host).
    wasm = example_guest("classify_named", guest_dir)
    require_backend("onnxruntime")
    config = batched_mobilenet(guest_models, batching)
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load_by_name("mobilenet")
        (cpu,) = rt.actors
        session = cpu.cached_session(graph._executable.id)  # type: ignore[attr-defined]
        assert session is not None
        compiled = session.compiled
        real_run = compiled.run
        entered, release = threading.Event(), threading.Event()
        seen: list[np.ndarray] = []

        def held_run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
            entered.set()
            release.wait(60)  # until the guest is gone
            seen.append(np.array(wasinn.tensor.as_tensor(inputs["input"]).numpy()))
            return real_run(inputs, **kwargs)

        compiled.run = held_run
        gate = threading.Event()
        guest_done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(cpu.execute, lambda: gate.wait(60)))
            await trio.testing.wait_all_tasks_blocked()
            guest_scope = trio.CancelScope()

            async def guest() -> None:
                with guest_scope:
                    await rt.run_wasm(wasm, argv=["mobilenet", "/d/input.bin"],
                                      dirs={"/d": str(guest_models.directory)})
                guest_done.set()

            nursery.start_soon(guest)
            with trio.fail_after(60):
                while cpu.stats().queued < 1:
                    await trio.sleep(0.01)
                gate.set()  # the batch of one starts: its run waits in held_run
                while not entered.is_set():
                    await trio.sleep(0.01)
                guest_scope.cancel()
                await guest_done.wait()
            gc.collect()  # nothing holds the guest's Store now
            release.set()
            with trio.fail_after(60):
                while cpu.stats().running:
                    await trio.sleep(0.01)
        compiled.run = real_run
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], guest_models.image)


async def test_guests_on_a_busy_device_share_batched_runs(
        guest_models: GuestModels, guest_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Four guests compute while the device's only slot is taken: with batching configured
    # their requests queue as one batch and run as one merged run of four rows.
    wasm = example_guest("classify_named", guest_dir)
    require_backend("onnxruntime")
    config = batched_mobilenet(guest_models)
    codes: list[int] = []
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load_by_name("mobilenet")
        (cpu,) = rt.actors

        async def guest() -> None:
            codes.append(await rt.run_wasm(wasm, argv=["mobilenet", "/d/input.bin"],
                                           dirs={"/d": str(guest_models.directory)}))

        gate = threading.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(cpu.execute, lambda: gate.wait(60)))
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(4):
                nursery.start_soon(guest)
            with trio.fail_after(60):
                while cpu.stats().queued < 4:
                    await trio.sleep(0.01)
            gate.set()
        stats = graph.stats()
    assert codes == [0, 0, 0, 0]
    tops = re.findall(r"top-1: class (\d+)", capfd.readouterr().out)
    assert tops == [str(native_top1(guest_models)[0])] * 4
    assert (stats.completed, stats.batches, stats.batched) == (4, 1, 4)
