"""The runtime's own lifetime: ``start``/``aclose`` called directly (from any task and
any cancel scope), what is readable after close, and config errors that only the start
can find."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend
from tests.loop_model import loop_inputs, loop_onnx
from tests.support import affine_pipeline_config, cpu_pool, require_backend
from tests.test_scheduler_routing import fake_config
from wasinn import ConfigError, InvalidArgumentError
from wasinn.configs import loader
from wasinn.modelgen import affine_onnx

X = np.ones((1, 4), np.float32)


class AppPath(os.PathLike[str]):
    """A path type of an application's own."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


class BytesPath(os.PathLike[bytes]):
    """A path of bytes, which no config path may be."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


async def still_serves(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    assert (await graph.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
    await graph.unload()


async def closed(rt: wasinn.Runtime) -> bool:
    try:
        await rt.load([affine_onnx()], "onnx")
    except wasinn.ClosedResourceError as exc:
        return "the runtime is closed" in exc.message
    return False


async def test_aclose_from_another_task_closes_the_runtime() -> None:
    rt = wasinn.Runtime()
    await rt.start()
    await still_serves(rt)
    actors = rt.actors
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rt.aclose)
    assert await closed(rt)
    assert all(not actor.ready for actor in actors)


@pytest.mark.parametrize("where", ["shielded finally", "move_on_after", "nursery"])
async def test_aclose_within_scopes_opened_after_start_closes_the_runtime(where: str) -> None:
    # trio ties a nursery to the task and nesting level that opened it: the actors are
    # served by a system task of their own, so these usual clean-ups work.
    rt = wasinn.Runtime()
    await rt.start()
    try:
        await still_serves(rt)
    finally:
        if where == "shielded finally":
            with trio.CancelScope(shield=True):
                await rt.aclose()
        elif where == "move_on_after":
            with trio.move_on_after(30):
                await rt.aclose()
        else:
            async with trio.open_nursery():
                await rt.aclose()
    assert await closed(rt)
    await rt.aclose()  # idempotent


def test_a_runtime_never_closed_is_stopped_when_trio_run_ends() -> None:
    started: list[wasinn.Runtime] = []

    async def forgetful() -> None:
        rt = wasinn.Runtime()
        await rt.start()
        await still_serves(rt)
        started.append(rt)  # and returns without closing it

    trio.run(forgetful)
    (rt,) = started
    assert all(not actor.ready for actor in rt.actors)
    assert not [t for t in threading.enumerate() if t.name.startswith("wasinn cpu worker")]


def test_a_runtime_stopped_with_its_trio_run_is_closed_to_a_later_run() -> None:
    # Before: a compute or a load from a later run advised "reach that run with
    # trio.from_thread" (a run that had ended), and aclose, idempotent, raised it too.
    kept: list[Any] = []

    async def forgetful() -> None:
        rt = wasinn.Runtime()
        await rt.start()
        graph = await rt.load([affine_onnx()], "onnx", name="aff")
        kept.extend([rt, graph.init_execution_context()])  # and returns, closing nothing

    async def later() -> None:
        rt, ctx = kept
        with pytest.raises(wasinn.ClosedResourceError, match=(
                r"^a request \(compute, run or lease\): the trio run this runtime served "
                r"has ended, and stopped the runtime with it: make a Runtime in this run$")):
            await ctx.compute({"x": np.ones((1, 4), np.float32)})
        with pytest.raises(wasinn.ClosedResourceError, match=r"^Runtime\.load: the trio run"):
            await rt.load([affine_onnx()], "onnx")
        await rt.aclose()  # nothing left to do
        await rt.aclose()

    trio.run(forgetful)
    trio.run(later)


def test_a_runtime_closed_by_aclose_says_so_to_a_later_run(tmp_path: Path) -> None:
    # Before: a later run was told that its trio run's end had stopped the runtime (the
    # message above), sending whoever chases the error to the wrong cause. Each call says
    # what it says in the runtime's own run after aclose.
    require_backend("onnxruntime")
    kept: list[Any] = []

    async def refusals() -> list[str]:
        rt, ctx, pipeline = kept
        said = []
        for call in (lambda: ctx.compute({"x": X}),  # a request of a graph
                     lambda: pipeline.compute({"x": X}),  # of a pipeline
                     lambda: rt.load([affine_onnx()], "onnx"),
                     lambda: rt.load_by_name("a")):
            with pytest.raises(wasinn.ClosedResourceError) as refused:
                await call()
            said.append(str(refused.value))
        return said

    async def closes() -> list[str]:
        async with wasinn.Runtime.from_config(affine_pipeline_config(tmp_path)) as rt:
            graph = await rt.load([affine_onnx()], "onnx", name="aff")
            kept.extend([rt, graph.init_execution_context(), await rt.load_by_name("p")])
        return await refusals()

    async def later() -> list[str]:
        said = await refusals()
        await kept[0].aclose()  # nothing left to do
        return said

    in_its_run = trio.run(closes)
    assert in_its_run == ["the runtime is closed: requests can no longer run"] * 2 + [
        "the runtime is closed"] * 2
    assert trio.run(later) == in_its_run


def wasinn_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("wasinn ")]


async def test_a_start_that_fails_stops_the_actors_that_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from wasinn.actors import device as device_module
    from wasinn.actors.devicectx import DeviceContext

    opened: list[str] = []

    class Broken(DeviceContext):  # cpu and gpu:0 start (with their threads), gpu:1 fails
        def open(self) -> None:
            if self.device.name == "gpu:1":
                raise RuntimeError("driver says no")
            opened.append(self.device.name)

    monkeypatch.setattr(device_module, "context_for", Broken)
    rt = wasinn.Runtime(fake_config(), backends=[FakeBackend()])
    with pytest.raises(wasinn.UnsupportedOperationError, match="gpu:1: cannot open the device"):
        await rt.start()
    assert opened == ["cpu", "gpu:0"]
    assert wasinn_threads() == []


async def test_aclose_while_starting_stops_what_started() -> None:
    rt = wasinn.Runtime(cpu_pool(workers=2))

    async def start() -> None:
        with pytest.raises(wasinn.ClosedResourceError, match="closed while it started"):
            await rt.start()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
        await trio.testing.wait_all_tasks_blocked()  # probing devices, in a thread
        await rt.aclose()
    assert wasinn_threads() == []
    assert await closed(rt)


async def test_a_runtime_starts_once_even_when_asked_twice_at_once() -> None:
    rt = wasinn.Runtime(cpu_pool(workers=1))
    outcomes: list[str] = []

    async def start() -> None:
        try:
            await rt.start()
            outcomes.append("started")
        except InvalidArgumentError as exc:
            outcomes.append(exc.message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
        nursery.start_soon(start)
    assert sorted(outcomes) == ["a Runtime can be started once", "started"]
    assert sorted(wasinn_threads()) == ["wasinn cpu compiler 0", "wasinn cpu worker 0"]
    await rt.aclose()
    assert wasinn_threads() == []


async def test_a_runtime_closed_before_it_started_says_so() -> None:
    rt = wasinn.Runtime(cpu_pool(workers=1))
    await rt.aclose()
    with pytest.raises(wasinn.ClosedResourceError, match="closed before it started"):
        await rt.start()
    assert wasinn_threads() == []


def test_runtime_arguments_of_the_wrong_kind_are_invalid_arguments() -> None:
    expected = "expected an iterable of wasinn.backends.Backend instances"
    for backends, said in (([5], rf"backends\[0\] is int: {expected}"),
                           (5, rf"backends=5 \(int\): {expected}")):
        with pytest.raises(InvalidArgumentError, match=said):
            wasinn.Runtime(backends=backends)  # type: ignore[arg-type]
    for path in (None, b"/x.toml", BytesPath(b"/x.toml")):
        with pytest.raises(InvalidArgumentError, match=r"config path .*: expected a str or "
                                                       r"an os\.PathLike of str \(a Path\)$"):
            wasinn.Runtime.from_config(path)  # type: ignore[arg-type]


async def test_a_second_aclose_returns_once_the_first_has_closed() -> None:
    rt = wasinn.Runtime(cpu_pool(workers=1, close_timeout=30.0))
    await rt.start()
    graph = await rt.load([loop_onnx()])
    (actor,) = rt.actors
    async with trio.open_nursery() as nursery:
        nursery.start_soon(closed_on, graph)
        while actor.busy == 0:  # the loop runs in the worker thread
            await trio.sleep(0.01)
        nursery.start_soon(rt.aclose)
        await trio.testing.wait_all_tasks_blocked()
        await rt.aclose()
        assert (actor.busy, wasinn_threads()) == (0, [])


async def closed_on(graph: wasinn.Graph) -> None:
    with pytest.raises(wasinn.ClosedResourceError):
        await graph.compute(loop_inputs(50_000_000))


async def test_async_with_pairs_start_and_aclose() -> None:
    async with trio.open_nursery() as nursery, wasinn.Runtime() as rt:
        nursery.start_soon(trio.sleep, 0)
        await still_serves(rt)
    with pytest.raises(wasinn.ClosedResourceError, match="the runtime is closed"):
        await rt.load([affine_onnx()])


async def test_a_runtime_not_started_has_no_stats() -> None:
    with pytest.raises(wasinn.ClosedResourceError, match="the runtime is not running"):
        wasinn.Runtime().stats()


async def test_device_stats_and_outputs_are_readable_after_close() -> None:
    async with wasinn.Runtime() as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)])
        ctx = graph.init_execution_context()
        await ctx.compute({"x": X})
        during = rt.stats()
    (after,) = rt.stats()  # the final figures, for a report after the block
    assert (after.device, after.completed, after.running, after.queued) == ("cpu", 1, 0, 0)
    assert after.completed == during[0].completed
    np.testing.assert_array_equal(ctx.get_output("y").numpy(), X * 2 + 1)
    with pytest.raises(wasinn.ClosedResourceError, match="the runtime is closed"):
        await ctx.run()


async def test_model_stats_are_readable_after_close(tmp_path: Path) -> None:
    (tmp_path / "a.onnx").write_bytes(affine_onnx(2.0, 1.0))
    (tmp_path / "wasinn.toml").write_text('[models.a]\nfiles = ["a.onnx"]\n'
                                          '[models.unused]\nfiles = ["a.onnx"]\n')
    async with wasinn.Runtime.from_config(tmp_path / "wasinn.toml") as rt:
        graph = await rt.load_by_name("a")
        for _ in range(3):
            await graph.compute({"x": X})
        during = rt.model_stats()
    after = rt.model_stats()
    assert [(s.name, s.completed) for s in after] == [("a", 3)]
    assert after == during


async def test_a_bad_backend_found_at_start_names_the_file_and_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Backend names are checked when the config is read and when the runtime is made;
    # should one get through (a config changed since), the start names the right key.
    path = tmp_path / "wasinn.toml"
    path.write_text('[runtime]\nbackends = ["onnxrutnime"]\n')
    with pytest.raises(ConfigError, match=r"runtime\.backends\[0\]: unknown backend"):
        wasinn.Runtime.from_config(path)
    monkeypatch.setattr(loader, "check_backends", lambda *args: None)
    rt = wasinn.Runtime(loader.load_config(path))
    with pytest.raises(ConfigError, match=rf"^{path}: runtime\.backends: .*unknown backend "
                                          r"'onnxrutnime'"):
        async with rt:
            pass


async def test_a_runtime_takes_a_config_path_and_refuses_anything_else(tmp_path: Path) -> None:
    config = tmp_path / "wasinn.toml"
    config.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 3\n')
    async with wasinn.Runtime(str(config)) as rt:
        assert rt.stats()[0].workers == 3
    async with wasinn.Runtime(config) as rt:
        assert rt.stats()[0].workers == 3
    # Any os.PathLike of str, as Runtime.from_config takes it. Before: refused, "expected
    # a RuntimeConfig, a TOML file's path or None ..., not PosixPath" (a trio.Path).
    for path in (trio.Path(config), AppPath(str(config))):
        async with wasinn.Runtime(path) as rt:
            assert rt.stats()[0].workers == 3
    with pytest.raises(InvalidArgumentError, match=r"config path .*\(BytesPath\): expected "
                                                   r"a str or an os\.PathLike of str"):
        wasinn.Runtime(BytesPath(bytes(config)))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="expected a RuntimeConfig, a TOML file"):
        wasinn.Runtime({"pools": {}})  # type: ignore[arg-type]
    with pytest.raises(wasinn.NotFoundError):
        wasinn.Runtime(tmp_path / "missing.toml")
