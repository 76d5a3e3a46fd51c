"""Edge cases of the PyTorch backend found by an adversarial review, each test failing on
the code before its fix: exported programs taking or returning more than a flat tuple of
tensors, outputs that are no tensor's values (None, a negated view, a meta tensor),
TorchScript signatures a run cannot fill, writes to the caller's input through operators
that do not declare their aliasing or through a list of views (``unbind``, ``split``),
models keeping tensors across runs, and TorchScript archives whose tensors claim more
bytes than their records hold."""
# Inputs and outputs are also named by position (ints), which run()'s annotations leave out.
# mypy: disable-error-code="dict-item,list-item,arg-type"

from __future__ import annotations

import io
import zipfile
from typing import Any

import numpy as np
import pytest

from tests.backend_models import scripted
from tests.support import require_backend
from wasinn import (
    BackendRuntimeError,
    GraphEncoding,
    InvalidEncodingError,
    Runtime,
    Tensor,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import Device, LoadOptions

pytestmark = pytest.mark.usefixtures("backend")  # each test needs torch

CPU = Device.parse("cpu")
PT = GraphEncoding.PYTORCH


@pytest.fixture
def backend() -> Any:
    require_backend("torch")
    from wasinn.backends.pytorch import TorchBackend

    return TorchBackend()


def _exported(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.export.save(torch.export.export(module, args, kwargs), buf)
    return buf.getvalue()


def _f32(*values: float) -> Tensor:
    return Tensor.from_numpy(np.array(values, np.float32))


# -- torch.export programs whose inputs or outputs are structured --------------------------
def test_exported_dict_and_nested_outputs_are_returned_as_their_tensors(backend: Any) -> None:
    # Before: the specs listed every tensor, but each run failed: "returned 1 values but
    # declares 2 outputs" for the dict, "returned 2 values but declares 3" for the nest.
    import torch

    class Named(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"b": x + 1, "a": x * 2}  # pytree keeps the dict's order: b, a

    class Nested(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return (x + 1, (x * 2, [x - 1])), x.sum()

    x = np.array([1.0, 2.0], np.float32)
    for module, expected in ((Named(), [x + 1, x * 2]),
                             (Nested(), [x + 1, x * 2, x - 1, x.sum()])):
        graph = backend.load([_exported(module, (torch.zeros(2),))], PT, CPU)
        assert [s.name for s in graph.outputs] == [f"output_{i}" for i in range(len(expected))]
        for keep in (False, True):
            out = graph.run({"x": Tensor.from_numpy(x)}, keep_on_device=keep)
            assert list(out) == [s.name for s in graph.outputs]
            for value, want in zip(out.values(), expected, strict=True):
                np.testing.assert_array_equal(value.numpy(), want)


def test_exported_keyword_nested_and_constant_arguments_run(backend: Any) -> None:
    # Before: each loaded with inputs named after its tensors, then every run failed in
    # torch's check of the input tree ("Trying to flatten user inputs ..." or "kwarg
    # keyword mismatch"): the run passed the tensors as flat positional arguments.
    import torch

    class Keyword(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
            return x - y

    class Pair(torch.nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor],
                    named: dict[str, torch.Tensor]) -> torch.Tensor:
            return pair[0] - pair[1] + named["z"] * 10 + named["a"] * 100

    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return x * n  # export fixes n to the 3 it was given

    def z() -> torch.Tensor:  # (export makes one tensor passed twice a single input)
        return torch.zeros(2)

    cases = [
        (_exported(Keyword(), (z(),), {"y": z()}), ["x", "y"], [5.0, 2.0], 3.0),
        (_exported(Pair(), ((z(), z()), {"z": z(), "a": z()})),
         ["pair_0", "pair_1", "named_z", "named_a"], [5.0, 2.0, 1.0, 1.0], 113.0),
        (_exported(Scaled(), (z(), 3)), ["x"], [2.0], 6.0),
    ]
    for data, names, values, expected in cases:
        graph = backend.load([data], PT, CPU)
        assert [s.name for s in graph.inputs] == names
        for keys in (names, range(len(names))):  # by name and by position
            out = graph.run({k: _f32(v, v) for k, v in zip(keys, values, strict=True)})
            np.testing.assert_array_equal(out["output"].numpy(), [expected] * 2)


@pytest.mark.parametrize("value", ["None", "an int"])
def test_an_exported_output_that_is_no_tensor_is_refused_at_load(
        backend: Any, value: str) -> None:
    # Before: a bare AttributeError ('NoneType' / 'int' object has no attribute 'meta').
    import torch

    class WithNone(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x + 1, None

    class WithSize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x + 1, x.shape[0]

    module, what = (WithNone(), "NoneType") if value == "None" else (WithSize(), "int")
    with pytest.raises(UnsupportedOperationError,
                       match=f"output 'output_1' is {what}, which wasi-nn cannot carry"):
        backend.load([_exported(module, (torch.zeros(2),))], PT, CPU)


# -- TorchScript signatures ----------------------------------------------------------------
def test_a_tensor_argument_after_a_defaulted_one_is_refused_at_load(backend: Any) -> None:
    # Before: it loaded with inputs x and y, and every run failed as the caller's fault
    # (InvalidArgumentError): y was passed by position into 'scale'.
    import torch

    class Late(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 2.0,
                    y: torch.Tensor = torch.zeros(1)) -> torch.Tensor:  # noqa: B008
            return x * scale + y

    with pytest.raises(UnsupportedOperationError,
                       match=r"'y' \(Tensor\) follows 'scale' \(float.*Tensor arguments first"):
        backend.load([scripted(Late())], PT, CPU)


# -- outputs that are not plain values -----------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_a_negated_view_comes_back_as_its_values(backend: Any, keep: bool) -> None:
    # Before: torch's bare RuntimeError "Can't call numpy() on Tensor that has negative
    # bit set", from the run, or (keep_on_device) from the result's numpy().
    import torch

    class Negated(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch._neg_view(x * 2)

    graph = backend.load([scripted(Negated())], PT, CPU)
    out = graph.run({"x": _f32(1.0, -3.0)}, keep_on_device=keep)["output"]
    np.testing.assert_array_equal(out.numpy(), [-2.0, 6.0])


def test_a_meta_tensor_output_is_a_runtime_error(backend: Any) -> None:
    # Before: torch's bare NotImplementedError "Cannot copy out of meta tensor".
    import torch

    class Meta(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros([2], device=torch.device("meta")) + x.sum()

    graph = backend.load([scripted(Meta())], PT, CPU)
    with pytest.raises(BackendRuntimeError, match="a tensor on meta: expected tensors on cpu"):
        graph.run({"x": _f32(1.0)})


# -- the caller's input memory -------------------------------------------------------------
_ALIASING = {  # each returns its input itself or a view of it, its schema says otherwise
    "dropout": "torch.nn.functional.dropout(x, 0.5, False)",
    "feature_dropout": "torch.feature_dropout(x, 0.5, False)",
    "alpha_dropout": "torch.alpha_dropout(x, 0.5, False)",
    "type_as": "x.type_as(x)",
    "_cast_Float": "torch._cast_Float(x)",
    "_unsafe_view": "torch.ops.aten._unsafe_view(x, [4])",
    "atleast_1d": "torch.atleast_1d(x)",
    "set_": "torch.empty([0]).set_(x)",
}
_MISSED = [("pt2", op) for op in ("dropout", "feature_dropout", "alpha_dropout", "type_as",
                                  "_cast_Float", "_unsafe_view", "atleast_1d")] \
    + [("script", op) for op in ("alpha_dropout", "type_as", "_cast_Float", "_unsafe_view",
                                 "set_")]


@pytest.mark.parametrize(("fmt", "op"), _MISSED)
def test_writes_through_unannotated_aliases_never_reach_the_callers_input(
        backend: Any, tmp_path: Any, fmt: str, op: str) -> None:
    # Before: the model wrote into the caller's array (a guest's memory): alias analysis
    # took what these operators return for new memory, so the input was not copied.
    import importlib.util

    import torch

    source = tmp_path / f"alias_{op}.py"  # (TorchScript compiles from source files)
    source.write_text(
        "import torch\n\n\nclass Model(torch.nn.Module):\n"
        "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
        f"        y = {_ALIASING[op]}\n"
        "        y.add_(1)\n"
        "        return y * 1\n")
    spec = importlib.util.spec_from_file_location(source.stem, source)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    model = loaded.Model().eval()
    data = scripted(model) if fmt == "script" else _exported(model, (torch.zeros(2, 2),))
    graph = backend.load([data], PT, CPU)
    caller = np.ones((2, 2), np.float32)
    for _ in range(2):
        out = next(iter(graph.run({"x": Tensor.from_numpy(caller)}).values()))
        np.testing.assert_array_equal(out.numpy().reshape(2, 2), np.full((2, 2), 2.0))
    np.testing.assert_array_equal(caller, np.ones((2, 2)))


def test_an_input_reaching_no_such_operator_is_still_not_copied(backend: Any) -> None:
    # The aliasing operators cost a copy only where an input reaches one: dropout on an
    # intermediate, then an in-place ReLU, leaves the input shared.
    import torch

    class Late(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.dropout(x * 2, 0.5, False)
            return y.relu_()

    for data in (scripted(Late()), _exported(Late().eval(), (torch.zeros(2),))):
        graph = backend.load([data], PT, CPU, LoadOptions(extra={"optimize": False}))
        assert graph._private == frozenset()
        np.testing.assert_array_equal(graph.run({"x": _f32(1.0, -1.0)})["output"].numpy(),
                                      [2.0, 0.0])


def _foreach_mul_(piece: Any) -> None:
    import torch

    torch._foreach_mul_([piece], 2.0)


_PIECES: dict[str, Any] = {  # a piece of x (2 x 4) from an operator returning many views
    "unbind": lambda x: x.unbind(1)[1],
    "split": lambda x: x.split(1, 0)[1],
    "split_with_sizes": lambda x: x.split([1, 3], 1)[1],
    "chunk": lambda x: x.chunk(2, 1)[1],
    "tensor_split": lambda x: x.tensor_split(2, 1)[0],
}
_WRITES: dict[str, Any] = {
    "add_": lambda piece: piece.add_(1.0),
    "mul_": lambda piece: piece.mul_(3.0),
    "copy_": lambda piece: piece.copy_(piece * 0 + 5.0),
    "index_put_": lambda piece: piece.index_put_((piece.new_zeros(1).long(),),
                                                 piece.new_full((), 9.0)),
    "_foreach_mul_": _foreach_mul_,
}


def _piece_writer(piece: Any, write: Any) -> Any:
    import torch

    class PieceWriter(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            write(piece(x))
            return x * 1

    return PieceWriter()


@pytest.mark.parametrize("write", list(_WRITES))
@pytest.mark.parametrize("piece", list(_PIECES))
def test_writes_into_a_piece_of_a_list_of_views_never_reach_the_callers_input(
        backend: Any, piece: str, write: str) -> None:
    # Before: the caller's array was written: the views in what unbind/split/chunk return
    # (schema Tensor(a -> *) self -> Tensor(a)[]) were not followed to the input.
    import torch

    model = _piece_writer(_PIECES[piece], _WRITES[write])
    graph = backend.load([_exported(model, (torch.zeros(2, 4),))], PT, CPU)
    caller = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
    eager = caller.copy()
    expected = model(torch.from_numpy(eager)).numpy()
    assert not np.array_equal(eager, caller)  # the model does write into its input
    for _ in range(2):
        np.testing.assert_array_equal(
            graph.run({"x": Tensor.from_numpy(caller)})["output"].numpy(), expected)
    np.testing.assert_array_equal(caller, np.arange(1.0, 9.0).reshape(2, 4))


async def test_compute_leaves_the_callers_array_as_it_was_after_a_write_through_unbind(
        ) -> None:
    import torch

    model = _piece_writer(_PIECES["unbind"], _WRITES["add_"])
    async with Runtime() as rt:
        graph = await rt.load([_exported(model, (torch.zeros(2, 4),))], "pytorch")
        x = np.ones((2, 4), np.float32)
        out = await graph.compute({"x": x})
        np.testing.assert_array_equal(out["output"].numpy(), [[1, 2, 1, 1], [1, 2, 1, 1]])
        np.testing.assert_array_equal(x, np.ones((2, 4)))


def test_a_model_only_reading_pieces_of_its_input_is_still_not_copied(backend: Any) -> None:
    # Following the views in a list costs a copy only where one is written to.
    import torch

    class Reader(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.unbind(0)
            left, right = x.chunk(2, 1)
            total = rows[0] + x.split([1, 1], 0)[1].squeeze(0) + x.tensor_split(2, 1)[1].sum()
            return total * left.sum() - right.mean()

    graph = backend.load([_exported(Reader(), (torch.zeros(2, 4),))], PT, CPU)
    assert graph._private == frozenset()
    caller = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
    expected = Reader()(torch.from_numpy(caller.copy())).numpy()
    np.testing.assert_allclose(graph.run({"x": Tensor.from_numpy(caller)})["output"].numpy(),
                               expected, rtol=1e-6)


def test_a_program_the_write_analysis_cannot_read_has_every_input_copied(
        backend: Any) -> None:
    # Before: an analysis that failed was an error out of the load; it now copies (safe).
    import types

    import torch

    from wasinn.backends._torch_memory import exported_written_inputs

    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + y

    program = torch.export.export(Pair(), (torch.zeros(2), torch.zeros(2)))
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    assert exported_written_inputs(program, placeholders) == frozenset()
    unreadable = types.SimpleNamespace(graph=program.graph, graph_signature=None)
    assert exported_written_inputs(unreadable, placeholders) == frozenset({0, 1})


# -- models that keep what they computed ---------------------------------------------------
def _kept_by_attribute() -> Any:
    import torch

    class Accumulator(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.total = torch.zeros(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool(x.sum() < 0):
                self.total = x * 1  # a tensor of this run's, kept for the next ones
            else:
                self.total.add_(x)
            return self.total

    return Accumulator()


def _kept_in_a_list() -> Any:
    import torch

    class History(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen = [torch.zeros(0)]  # (not empty: TorchScript infers its type)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.seen[-1].numel() == 0:
                self.seen.append(x * 1)
            else:
                self.seen[-1].add_(x)
            return self.seen[-1]

    return History()


@pytest.mark.parametrize("model", [_kept_by_attribute, _kept_in_a_list])
@pytest.mark.parametrize("keep", [False, True])
def test_an_output_the_model_keeps_is_not_changed_by_later_runs(
        backend: Any, model: Any, keep: bool) -> None:
    # Before: the first run's output was the tensor the model kept (its memory unknown
    # at load, so not cloned): the second run's add_ changed the first caller's result.
    graph = backend.load([scripted(model())], PT, CPU)
    first = graph.run({"x": _f32(-1.0, -1.0)}, keep_on_device=keep)["output"]
    second = graph.run({"x": _f32(10.0, 10.0)}, keep_on_device=keep)["output"]
    np.testing.assert_array_equal(first.numpy(), [-1.0, -1.0])
    np.testing.assert_array_equal(second.numpy(), [9.0, 9.0])


def test_a_model_that_keeps_nothing_still_hands_out_its_outputs_uncopied(
        backend: Any) -> None:
    graph = backend.load([scripted(_weighted_module())], PT, CPU)
    assert graph._stateful is False
    graph = backend.load([scripted(_weighted_module())], PT, CPU,
                         LoadOptions(extra={"optimize": False}))
    assert graph._stateful is False


# -- TorchScript archives whose tensors claim more than their records ----------------------
def _weighted_module() -> Any:
    import torch

    class Weighted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))
            self.register_buffer("b", torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w + self.b

    return Weighted()


def _edited(data: bytes, name: str, content: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for entry in src.namelist():
            dst.writestr(entry, content if entry == name else src.read(entry))
    return out.getvalue()


class _ReaderBefore213:
    """torch's archive reader as torch < 2.13 has it: no ``get_record_size``."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        if name == "get_record_size":
            raise AttributeError(name)
        return getattr(self._reader, name)


@pytest.mark.parametrize("torch_reader", ["this torch's", "torch < 2.13's"])
def test_a_weight_shorter_than_its_tensor_is_refused(
        backend: Any, torch_reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: torch.jit.load took the 16 bytes the pickle promised from a 4-byte record:
    # the buffer, and every run's output, held host memory past the record. (And with
    # torch 2.11's reader, which cannot give a record's size, every TorchScript load
    # failed with an AttributeError.)
    if torch_reader != "this torch's":
        import torch

        reader = torch._C.PyTorchFileReader
        monkeypatch.setattr(torch._C, "PyTorchFileReader",
                            lambda data: _ReaderBefore213(reader(data)))
    data = _edited(scripted(_weighted_module()), "archive/data/1", b"\x00\x00\x80\x3f")
    with pytest.raises(InvalidEncodingError, match=r"storage '1' 4 elements of FloatStorage, "
                                                   r"but 'data/1' holds 4 bytes"):
        backend.load([data], PT, CPU)


def test_an_empty_weight_record_cannot_crash_the_host(tmp_path: Any) -> None:
    # Before: the storage had no memory, and freezing the module at load crashed the
    # process (segmentation fault): run in a child, so that it can only fail the test.
    import subprocess
    import sys

    model = tmp_path / "empty.pt"
    model.write_bytes(_edited(scripted(_weighted_module()), "archive/data/1", b""))
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys\n"
         "from wasinn import GraphEncoding, InvalidEncodingError\n"
         "from wasinn.backends import Device\n"
         "from wasinn.backends.pytorch import TorchBackend\n"
         "try:\n"
         "    TorchBackend().load([open(sys.argv[1], 'rb').read()], GraphEncoding.PYTORCH,\n"
         "                        Device.parse('cpu'))\n"
         "except InvalidEncodingError as exc:\n"
         "    print(exc)\n", str(model)],
        capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "storage '1' 4 elements of FloatStorage, but 'data/1' holds 0 bytes" in child.stdout


def test_a_pickle_claiming_more_elements_than_the_record_is_refused(backend: Any) -> None:
    # Before: the buffer's storage declared 255 floats over a 16-byte record: the load
    # went through, reading past the record when the tensor was used.
    data = scripted(_weighted_module())
    pickled = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    key = pickled.index(b"X\x01\x00\x00\x001")  # the buffer's storage key '1'
    at = pickled.index(b"K\x04", key)  # its element count, 4
    edited = pickled[:at] + b"K\xff" + pickled[at + 2:]
    with pytest.raises(InvalidEncodingError, match=r"255 elements of FloatStorage.*16 bytes"):
        backend.load([_edited(data, "archive/data.pkl", edited)], PT, CPU)


def test_archives_with_every_carried_storage_type_still_load(backend: Any) -> None:
    # The storage check reads the element size of each type, frozen constants included.
    import torch

    from wasinn.backends._torch_tensors import _TORCH_TYPES

    class Typed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.typed = [torch.ones(3, dtype=_TORCH_TYPES[t]) for t in TensorType]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for value in self.typed:
                x = x + value.float()
            return x

    scripted = torch.jit.script(Typed()).eval()
    frozen = torch.jit.freeze(scripted)
    for module in (scripted, frozen):
        buf = io.BytesIO()
        torch.jit.save(module, buf)
        for optimize in (False, True):
            graph = backend.load([buf.getvalue()], PT, CPU,
                                 LoadOptions(extra={"optimize": optimize}))
            np.testing.assert_array_equal(graph.run({"x": _f32(0, 1, 2)})["output"].numpy(),
                                          [7, 8, 9])
    assert any(n.startswith("archive/constants/")
               for n in zipfile.ZipFile(io.BytesIO(buf.getvalue())).namelist())
