"""What a compromised sandbox process answers cannot cost the host more than the graph it
serves could: a run's reply is checked against the outputs the run asked for, as the
graph declared them, before anything is copied out of the arena, and the larger arena
it may ask for is bounded by what the process may hold; a load's description of the
model is checked whole, and one that is not a graph's ends the process and frees its
place under the host's bound.

The process is made hostile by :mod:`tests.compromised_backend` (its load rewrites the
process's answers), standing in for a library bug that ran a model's code there.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import wasinn
from tests.compromised_backend import CompromisedBackend, ones
from tests.sandbox_memory import held_before_load
from tests.support import sandbox_children
from wasinn import BackendRuntimeError, GraphEncoding, InvalidArgumentError, TensorType
from wasinn.backends import Device, LoadOptions
from wasinn.backends.base import CompiledGraph, TensorSpec
from wasinn.backends.sandbox import ProcessLimit, Spares, load_sandboxed

CPU = Device.parse("cpu")
MiB = 1 << 20


@pytest.fixture
def spares() -> Iterator[Spares]:
    """A pool that keeps no spares, under a bound of its own: every process it counted
    has ended by the test's end."""
    pool = Spares(0, limit=ProcessLimit(2))
    yield pool
    assert pool.limit.live == 0
    assert sandbox_children() == []


def _replying(said: dict[str, Any], spares: Spares, **options: Any) -> Any:
    return load_sandboxed(CompromisedBackend(), [b"reply:" + json.dumps(said).encode()],
                          GraphEncoding.GGML, CPU, LoadOptions(**options), spares=spares)


# -- a run's reply ----------------------------------------------------------------------------
def test_a_reply_of_many_tensors_over_the_same_bytes_is_refused_before_any_copy(
        spares: Spares) -> None:
    # Before: the host copied every tensor described (64 MiB here: one reply of 400,000
    # described 400 GB), then refused the reply for naming outputs the graph lacks.
    tensors = [[f"t{i}", "u8", [MiB], 0] for i in range(64)]
    graph = _replying({"grow": 2 * MiB, "tensors": tensors}, spares)
    try:
        tracemalloc.start()
        try:
            with pytest.raises(BackendRuntimeError, match=(
                    r"^compromised: the process running the model answered badly: output "
                    r"'t0', which the model does not declare: expected outputs y: f32\[2\]$")):
                graph.run(ones())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * MiB, peak
        assert graph.pid is None  # retired, as any process that answers badly
    finally:
        graph.close()


@pytest.mark.parametrize(("tensors", "said"), [
    # the declared output, of another type and size
    ([["y", "u8", [MiB], 0]], r"output 'y' is u8\[1048576\]: expected y: f32\[2\], as the "
                              r"model declares"),
    # the declared output, then again under the same name
    ([["y", "f32", [2], 0], ["y", "f32", [2], 0]], r"tensor 'y' described twice"),
])
def test_a_reply_that_is_not_the_declared_outputs_is_refused(
        spares: Spares, tensors: list[Any], said: str) -> None:
    graph = _replying({"tensors": tensors}, spares)
    try:
        with pytest.raises(BackendRuntimeError, match=(
                rf"^compromised: the process running the model answered badly: {said}$")):
            graph.run(ones())
    finally:
        graph.close()


def test_a_reply_may_ask_for_no_larger_arena_than_the_process_may_hold(
        spares: Spares) -> None:
    # Before: any arena up to 1 TiB, which the host made and mapped. The bound leaves the
    # process 64 MiB past what it holds before its load (0.1 GB on 2 cores, 0.7 GB on 16),
    # and the reply asks for 1 GiB more than the bound.
    recipe = [b"reply:" + json.dumps({"tensors": []}).encode()]
    bound = held_before_load(CompromisedBackend(), recipe, GraphEncoding.GGML, spares) \
        + 64 * MiB
    asked = bound + (1 << 30)
    graph = _replying({"grow": asked, "tensors": []}, spares, max_sandbox_bytes=bound)
    try:
        with pytest.raises(BackendRuntimeError, match=(
                r"^compromised: the process running the model answered badly: a reply "
                rf"asking for an arena of {asked} bytes: expected more than its \d+ and at "
                r"most \d+$")) as caught:
            graph.run(ones())
        most = int(caught.value.message.rsplit(" ", 1)[1])
        assert most < bound + 2 * MiB  # the arena, and the process's bound
    finally:
        graph.close()


def _expect(most: int = MiB, asked: list[str] | None = None, *, declared: bool = True
            ) -> Any:
    """What a reply to a run of a graph declaring ``y: f32[?]`` and ``z: u8[4]`` may
    hold (``declared=False``: a reply that may hold no tensor)."""
    from wasinn.backends._sandbox_wire import DeclaredOutputs, Expected

    if not declared:
        return Expected()
    specs = [TensorSpec("y", wasinn.TensorType.F32, (None,)),
             TensorSpec("z", wasinn.TensorType.U8, (4,))]
    return DeclaredOutputs("b", specs, {}, typed=True).expect(asked, most)


@pytest.mark.parametrize(("tensors", "expected", "said"), [
    ([["y", "f32", [2], 64], ["z", "u8", [4], 68]], {},
     r"^tensors 'y' and 'z' share bytes of the arena: expected each output in bytes of its "
     r"own$"),
    ([["y", "f32", [64], 0], ["z", "u8", [4], 256]], {"most": 259},
     r"^outputs of 260 bytes together: expected at most 259, what the sandbox process may "
     r"hold$"),
    ([["y", "f32", [2], 0]], {}, r"^no output z: u8\[4\]: expected outputs "
                                 r"y: f32\[\?\], z: u8\[4\]$"),
    ([["y", "f32", [2], 0], ["z", "u8", [4], 64]], {"asked": ["z"]},
     r"^output 'y', which the run did not ask for: expected outputs z: u8\[4\]$"),
    ([["y", "f32", [2], 0]], {"declared": False}, r"^tensor 'y' in a reply that has none$"),
])
def test_the_tensors_of_a_reply_are_checked_together_before_any_is_copied(
        tensors: list[Any], expected: dict[str, Any], said: str) -> None:
    from wasinn.backends._sandbox_wire import Arena, read_reply

    arena = Arena.create(4096)
    try:
        header = json.dumps({"ok": True, "tensors": tensors}).encode()
        with pytest.raises(ValueError, match=said):
            read_reply(arena, header, _expect(**expected))
        fine = json.dumps({"ok": True, "tensors": [["y", "f32", [2], 0],
                                                   ["z", "u8", [4], 8]]}).encode()
        _, back = read_reply(arena, fine, _expect())
        assert sorted(back) == ["y", "z"] and back["z"].dims == (4,)
    finally:
        arena.close()


def test_an_error_reply_carries_no_tensor_nor_may_a_load_ask_for_room() -> None:
    from wasinn.backends._sandbox_wire import Arena, read_reply

    arena = Arena.create(4096)
    try:
        with pytest.raises(ValueError, match=r"^a reply with an error and tensors$"):
            read_reply(arena, b'{"error": ["BackendRuntimeError", "no"], "tensors": '
                              b'[["y", "f32", [2], 0]]}', _expect())
        with pytest.raises(ValueError, match=r"^a reply asking for an arena of 8192 bytes: "
                                             r"expected more than its 4096 and at most 4096$"):
            read_reply(arena, b'{"grow": 8192}', _expect(declared=False))
    finally:
        arena.close()


# -- a load's description of the model -----------------------------------------------------
@pytest.mark.parametrize(("specs", "said"), [
    # Before: an OverflowError, and the process kept its place under the bound.
    ('{"outputs": [["y", "f32", [Infinity], true]]}',
     r"output 0 'y' of dimension inf: expected null \(dynamic\) or an integer from 0 to "
     r"9223372036854775807"),
    # Before: an InvalidArgumentError, and the process kept its place.
    ('{"outputs": [["y", "f32", [2], false]]}',
     r"output 0 'y' of dimensions \[2\] but of unknown rank: expected no dimension"),
    # Before: accepted.
    ('{"outputs": [["y", "f32", [-3], true]]}', r"output 0 'y' of dimension -3: "),
    ('{"inputs": [["x", "f32", [2.0], true]]}', r"input 0 'x' of dimension 2.0: "),
    ('{"inputs": [["x", "f32", [true], true]]}', r"input 0 'x' of dimension True: "),
    ('{"output_aliases": {"z": 7}}',
     r"output alias 'z' of position 7: expected one from 0 to 0"),
    ('{"output_aliases": {"z": -1}}', r"output alias 'z' of position -1: "),
    ('{"input_aliases": {"z": true}}', r"input alias 'z' of position True: "),
    ('{"outputs": [["y", "f32", [2], true], ["y", "f32", [2], true]]}',
     r"output 'y' declared twice: expected each output to have a name of its own"),
    ('{"outputs": [["y", "f128", [2], true]]}', r"output 0 'y' of type 'f128': expected one "
                                               r"of "),
    ('{"outputs": [["y", "f32", [2], 1]]}', r"output 0 \['y', 'f32', \[2\], 1\]: expected "
                                            r"\[name, type, dims, rank_known\] or \[name, "
                                            r"type, dims, rank_known, bounds\]$"),
    ('{"outputs": [["y", "f32", [2], true, [[2, 2]], 0]]}', r"output 0 .*: expected \[name, "),
    # Bounds (a fifth element, where the model limits its dynamic dimensions' sizes).
    ('{"inputs": [["x", "f32", [null], true, {"low": 2}]]}',
     r"input 0 'x' of bounds \{'low': 2\}: expected a list of 1 \[low, high\], one per "
     r"dimension$"),
    ('{"inputs": [["x", "f32", [null, 3], true, [[2, 8]]]]}',
     r"input 0 'x' of bounds \[\[2, 8\]\]: expected a list of 2 "),
    ('{"inputs": [["x", "f32", [], false, [[2, 8]]]]}',
     r"input 0 'x' of bounds \[\[2, 8\]\]: expected a list of 0 "),
    ('{"inputs": [["x", "f32", [null], true, [[8, 2]]]]}',
     r"input 0 'x' of bound \[8, 2\] in dimension 0: expected \[low, high\], integers from "
     r"0 to 9223372036854775807, low <= high, or \[low, null\] \(no upper bound\)$"),
    ('{"inputs": [["x", "f32", [null], true, [[-1, 2]]]]}', r"input 0 'x' of bound \[-1, 2\] "),
    ('{"inputs": [["x", "f32", [null], true, [[2, Infinity]]]]}',
     r"input 0 'x' of bound \[2, inf\] "),
    ('{"inputs": [["x", "f32", [null], true, [[0, 9223372036854775808]]]]}',
     r"input 0 'x' of bound \[0, 9223372036854775808\] "),
    ('{"inputs": [["x", "f32", [null], true, [[true, 2]]]]}',
     r"input 0 'x' of bound \[True, 2\] "),
    ('{"inputs": [["x", "f32", [null], true, [[1.0, 2]]]]}', r"input 0 'x' of bound \[1.0, 2\] "),
    ('{"inputs": [["x", "f32", [null], true, [[null, 2]]]]}',
     r"input 0 'x' of bound \[None, 2\] "),
    ('{"inputs": [["x", "f32", [null], true, [[1, 2, 3]]]]}',
     r"input 0 'x' of bound \[1, 2, 3\] "),
    ('{"inputs": [["x", "f32", [null], true, [2]]]}', r"input 0 'x' of bound 2 "),
    ('{"inputs": [["x", "f32", [2], true, [[1, 4]]]]}',
     r"input 0 'x' of bound \[1, 4\] in dimension 0, of fixed size 2: expected \[2, 2\]$"),
    ('{"outputs": {"y": 1}}', r"outputs \{'y': 1\}: expected a list"),
    ('{"output_types_declared": 1}', r"output_types_declared 1: expected true or false"),
])
def test_a_load_that_describes_no_graph_ends_its_process(
        spares: Spares, specs: str, said: str) -> None:
    with pytest.raises(BackendRuntimeError, match=(
            rf"^compromised: the process loading the model answered badly: {said}")):
        load_sandboxed(CompromisedBackend(), [b"specs:" + specs.encode()],
                       GraphEncoding.GGML, CPU, spares=spares)
    assert spares.limit.live == 0  # (and no process left: see the fixture)


def test_a_load_that_describes_a_graph_runs() -> None:
    graph = load_sandboxed(CompromisedBackend(), [b'specs:{"output_aliases": {"z": 0}}'],
                           GraphEncoding.GGML, CPU)
    try:
        assert dict(graph.output_aliases) == {"z": 0}
        out = graph.run(ones(), outputs=["z"])
        assert out["y"].numpy().tolist() == [1.0, 1.0]
    finally:
        graph.close()


def test_a_load_that_describes_bounds_has_the_host_check_them_before_a_run() -> None:
    # Before: the process sent no bounds, and the host's spec said x: f32[?].
    graph = load_sandboxed(
        CompromisedBackend(), [b'specs:{"inputs": [["x", "f32", [null], true, [[2, 8]]]]}'],
        GraphEncoding.GGML, CPU)
    try:
        assert graph.inputs == (TensorSpec("x", TensorType.F32, (None,), bounds=((2, 8),)),)
        assert graph.inputs[0].describe() == "x: f32[2..8]"
        assert graph.outputs[0].bounds == ()  # (a spec of 4 elements: none)
        assert graph.run(ones())["y"].numpy().tolist() == [1.0, 1.0]
        # (the graph in the process checks nothing: it would return the 1 element)
        with pytest.raises(InvalidArgumentError, match=(
                r"^compromised: input 'x' has size 1 in dimension 0, but the model allows 2 "
                r"to 8 there \(expected x: f32\[2\.\.8\]\)$")):
            graph.run({"x": np.ones(1, np.float32)})
    finally:
        graph.close()


def test_a_process_sends_the_bounds_it_has_as_the_host_reads_them() -> None:
    from wasinn.backends._sandbox_child import _specs
    from wasinn.backends._sandbox_specs import read_specs

    inputs = (TensorSpec("x", TensorType.F32, (None, 3, None), bounds=((2, 8), (3, 3), (0, None))),
              TensorSpec("s", TensorType.I64, ()))
    outputs = (TensorSpec("y", TensorType.F32, (None, 3)),)
    graph = SimpleNamespace(inputs=inputs, outputs=outputs, input_aliases={}, output_aliases={},
                            output_types_declared=True)
    said = json.loads(json.dumps(_specs(cast(CompiledGraph, graph))))
    assert [len(spec) for spec in said["inputs"]] == [5, 4]  # (bounds only where there are)
    specs = read_specs(said)
    assert (specs.inputs, specs.outputs) == (inputs, outputs)


def test_an_arena_too_large_to_make_fails_as_the_system_would() -> None:
    # Before: an OverflowError (not an OSError), which escaped the run as it was.
    from wasinn.backends._sandbox_wire import Arena

    arena = Arena.create(4096)
    try:
        with pytest.raises(OSError, match=r"^\[Errno 27\] 9223372036854775808 bytes: "):
            arena.grow(2**63)
        assert arena.size == 4096
        arena.view(0, 4)[:] = b"four"  # still mapped
    finally:
        arena.close()
