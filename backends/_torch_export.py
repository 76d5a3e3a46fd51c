"""Loading a ``torch.export`` archive (``.pt2``) as a :class:`~._torch_graph.TorchGraph`
(for :mod:`wasinn.backends.pytorch`).

The archive is recognised by its ``archive_format`` entry and checked before torch reads
it; one load at a time in the process (torch keeps the archive being read in a global).
The program is moved to the device (its constants and the devices its graph names
included), its operators checked, its integer divisions guarded and a checkpoint put
before each operator. Its specs come from the graph's placeholders; a program whose
inputs or outputs are more than a flat tuple of tensors is called through
:class:`_Flattened`; the exported ranges of its symbolic dims are read for the graph
to check before each run. What torch's caches keep of each load is given back after it
(:mod:`._torch_export_caches`).
"""

from __future__ import annotations

import dataclasses
import io
import threading
import zipfile
from typing import Any

import torch
import torch.export.passes
import torch.utils._pytree as pytree
from torch.export.graph_signature import ConstantArgument, InputKind

from wasinn.errors import InvalidEncodingError

from ._graphio import uncarried_type
from ._pt2_check import check_pt2_archive
from ._torch_cancel import _interruptible
from ._torch_division import guard_exported_divisions
from ._torch_export_caches import drop_dead_sources, forget_shape_envs, sources_mark
from ._torch_graph import NAME, TorchGraph, _first_line, _output_names
from ._torch_memory import exported_written_inputs, module_storages
from ._torch_ops import check_exported_program
from ._torch_tensors import _TYPES
from .base import Device, TensorSpec


def _is_exported_program(data: bytes) -> bool:
    """Whether ``data`` is a ``.pt2`` archive: False for bytes that are no zip (torch
    then reads them as TorchScript, and says what is wrong); InvalidEncodingError for a
    zip that zipfile cannot read, whatever it raises (NotImplementedError for a
    compression or version it lacks, among others)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return any(n.endswith("/archive_format") for n in archive.namelist())
    except zipfile.BadZipFile:
        return False
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot read the model's zip archive ({type(exc).__name__}: {exc}): "
            "expected a TorchScript or torch.export archive"
        ) from exc


def _spec_of(name: str, value: Any, role: str) -> TensorSpec:
    ttype = _TYPES.get(getattr(value, "dtype", None))  # type: ignore[arg-type]
    if ttype is None:
        raise uncarried_type(
            NAME, role, name, f"is {getattr(value, 'dtype', type(value).__name__)}"
        )
    shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    return TensorSpec(name, ttype, shape)


#: torch.export.load keeps the archive it is reading in a module global
#: (``_CURRENT_DESERIALIZER``): two loads at once in different threads fail with "already
#: set". Loads on different devices' worker threads, or a runtime preloading several
#: programs, take turns.
_EXPORT_LOAD = threading.Lock()


def _load_exported(data: bytes, device: Device, torch_device: torch.device) -> TorchGraph:
    check_pt2_archive(NAME, data)  # torch.export.load unpickles and evaluates what it reads
    mark = sources_mark()
    try:
        return _exported_graph(data, device, torch_device)
    finally:  # what torch keeps of the load, loaded or not (see ._torch_export_caches):
        # the steps after torch.export.load (moving the program, making its module) leave
        # entries in the ShapeEnv caches too
        with _EXPORT_LOAD:
            forget_shape_envs()
        drop_dead_sources(mark)


def _exported_graph(data: bytes, device: Device, torch_device: torch.device) -> TorchGraph:
    try:
        with _EXPORT_LOAD:
            try:
                program = torch.export.load(io.BytesIO(data))
            finally:
                forget_shape_envs()
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the torch.export archive: {_first_line(exc)}"
        ) from exc
    check_exported_program(NAME, program.graph_module)
    try:
        program = _program_on(program, torch_device)
        module = program.module()
        guard_exported_divisions(module)
        _interruptible(module)
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the torch.export archive: {_first_line(exc)}"
        ) from exc
    signature = program.graph_signature
    user_inputs = set(signature.user_inputs)
    placeholders = [n for n in program.graph.nodes
                    if n.op == "placeholder" and n.name in user_inputs]
    ranges = _dim_ranges(program, placeholders)
    inputs = tuple(_bounded(_spec_of(n.name, n.meta.get("val"), "input"), ranges.get(i, {}))
                   for i, n in enumerate(placeholders))
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = list(out_node.args[0])[-len(signature.user_outputs):]
    names = _output_names(len(user_outputs))
    # A constant output (None, an int) is no fx node: it has no tensor to hand out.
    outputs = tuple(_spec_of(name, node.meta.get("val") if isinstance(node, torch.fx.Node)
                             else node, "output")
                    for name, node in zip(names, user_outputs, strict=True))
    return TorchGraph(
        _flat_calls(program, module, len(placeholders), len(outputs)), device, inputs,
        outputs, checked=True,
        private=exported_written_inputs(program, placeholders),
        model_storages=module_storages(module),
    )


def _program_on(program: Any, torch_device: torch.device) -> Any:
    """``program`` moved to ``torch_device``: its parameters and buffers, and also its
    lifted tensor constants and the devices its graph names (``torch.arange(n)`` records
    ``device=cpu``), which the module's ``.to()`` would leave on the CPU, so that every
    run on a GPU would fail with tensors on two devices."""
    if torch_device.type == "cpu":
        return program
    return torch.export.passes.move_to_device_pass(program, torch_device)


#: Where :class:`_Flattened` passes one of the run's tensors.
_TENSOR = object()


class _Flattened(torch.nn.Module):
    """An exported program whose inputs or outputs are more than a flat tuple of tensors,
    called as its specs describe it: with its tensor inputs in order (placed, with the
    constants export fixed, into the arguments it was exported with), returning the
    tensors of its result in pytree order."""

    def __init__(self, program: torch.nn.Module, leaves: list[Any], in_spec: Any) -> None:
        super().__init__()
        self.program = program
        self._leaves = leaves  # each input leaf: _TENSOR, or the constant export fixed
        self._in_spec = in_spec

    def forward(self, *tensors: torch.Tensor) -> list[Any]:
        given = iter(tensors)
        args, kwargs = pytree.tree_unflatten(
            [next(given) if leaf is _TENSOR else leaf for leaf in self._leaves], self._in_spec)
        return pytree.tree_leaves(self.program(*args, **kwargs))


def _flat_calls(program: Any, module: torch.nn.Module, inputs: int,
                outputs: int) -> torch.nn.Module:
    """``module`` (the program's), called with ``inputs`` tensors and returning
    ``outputs`` (one, or a tuple or list of them) as the specs say; else a
    :class:`_Flattened` wrapping it: without it, such a program loads but every run fails
    in torch's input pytree check, or returns a dict or nested tuple."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    leaves = [spec.arg.value if isinstance(spec.arg, ConstantArgument) else _TENSOR
              for spec in program.graph_signature.input_specs
              if spec.kind is InputKind.USER_INPUT]
    flat_in = in_spec == pytree.tree_structure((tuple(range(inputs)), {})) \
        and all(leaf is _TENSOR for leaf in leaves)
    flat_out = out_spec in (pytree.tree_structure(0), pytree.tree_structure(tuple(range(outputs))),
                            pytree.tree_structure(list(range(outputs))))
    return module if flat_in and flat_out else _Flattened(module, leaves, in_spec)


def _dim_ranges(program: Any, placeholders: list[Any]
                ) -> dict[int, dict[int, tuple[int, int | None]]]:
    """The checked range ``(low, high)`` of each input dim that is a plain symbol
    (``Dim("n")``), by input and axis, where torch checks one: a lower bound above 2
    (torch does not check 0, 1 or 2: 0 here), a finite upper bound (None: none)."""
    ranges: dict[int, dict[int, tuple[int, int | None]]] = {}
    for index, node in enumerate(placeholders):
        for axis, size in enumerate(getattr(node.meta.get("val"), "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            bounds = program.range_constraints.get(size.node.expr)
            if bounds is None:
                continue
            low = int(bounds.lower) if bounds.lower.is_Integer else 0  # not -int_oo
            high = int(bounds.upper) if bounds.upper.is_Integer else None  # not int_oo
            low = low if low > 2 else 0
            if low or high is not None:
                ranges.setdefault(index, {})[axis] = (low, high)
    return ranges


def _bounded(spec: TensorSpec, ranges: dict[int, tuple[int, int | None]]) -> TensorSpec:
    """``spec`` with the bounds of its dims that have a checked ``ranges`` (by axis)."""
    if not ranges:
        return spec
    bounds = tuple((size, size) if size is not None else ranges.get(axis, (0, None))
                   for axis, size in enumerate(spec.shape))
    return dataclasses.replace(spec, bounds=bounds)
