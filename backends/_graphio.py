"""Input checking and output selection shared by the built-in backends.

Every backend validates a run's inputs against its graph's :class:`TensorSpec` s before
calling its library, so a wrong name, element type or shape is an InvalidArgumentError
that says what the model expects instead of a library message. The checks are
precomputed per graph so that they cost a few dictionary lookups per run.
:class:`CheckedGraph` runs them, with the closed-graph check, in one place for every
built-in backend.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from wasinn.enums import GraphEncoding, TensorType
from wasinn.errors import (
    ClosedResourceError,
    InvalidArgumentError,
    InvalidEncodingError,
    UnknownNameError,
    UnsupportedOperationError,
    quoted,
)
from wasinn.tensor import Tensor, as_tensor

from .base import Builders, CompiledGraph, Device, TensorSpec, outside_bounds


def expect_builders(backend: str, builders: Builders, count: int, what: str) -> None:
    """InvalidEncodingError unless there are exactly ``count`` non-empty builders."""
    if len(builders) == 0:
        raise InvalidEncodingError(f"{backend}: empty builder list: expected {what}")
    if len(builders) != count:
        given = "1 builder" if len(builders) == 1 else f"{len(builders)} builders"
        raise InvalidEncodingError(f"{backend}: {given} given: expected {what}")
    for i, b in enumerate(builders):
        if memoryview(b).nbytes == 0 and not (count == 2 and i == 1):
            raise InvalidEncodingError(f"{backend}: builder {i} is empty: expected {what}")


def expect_encoding(backend: str, encoding: GraphEncoding, reads: GraphEncoding) -> None:
    """InvalidEncodingError unless ``encoding`` is the one encoding the backend reads, or
    autodetect (the bytes are then checked by the library itself)."""
    if encoding not in (reads, GraphEncoding.AUTODETECT):
        raise InvalidEncodingError(f"{backend}: reads {reads.value} models, not {encoding.value}")


def no_device(backend: str, device: Device, devices: Sequence[Device]) -> UnsupportedOperationError:
    """The error for a load onto ``device`` when the backend has only ``devices`` here."""
    return UnsupportedOperationError(
        f"{backend}: no device {device} here: expected one of "
        f"{', '.join(d.name for d in devices)}"
    )


def uncarried_type(backend: str, role: str, name: str, what: str) -> UnsupportedOperationError:
    """The error for a graph input or output whose element type is none of wasi-nn's
    (``what`` names the library's type, e.g. ``has element type tensor(string)``): such a
    graph cannot load, since no run could hand that tensor across."""
    return UnsupportedOperationError(
        f"{backend}: {role} {name!r} {what}, which wasi-nn cannot carry: expected one of "
        f"{', '.join(t.value for t in TensorType)}"
    )


def out_of_bounds(backend: str, spec: TensorSpec, axis: int, size: int, low: int,
                  high: int | None, allows: str = "allows") -> InvalidArgumentError:
    """The error for input ``spec`` given ``size`` in dimension ``axis``, outside the
    ``low`` to ``high`` the model ``allows`` there (see :func:`.base.outside_bounds`)."""
    return InvalidArgumentError(
        f"{backend}: {outside_bounds(spec, axis, size, low, high, allows)}")


def _describe_all(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(s.describe() for s in specs) or "none"


def _keys(specs: Sequence[TensorSpec], aliases: Mapping[str, int] | None) -> dict[str | int, int]:
    keys: dict[str | int, int] = {}
    for name, index in (aliases or {}).items():
        keys[name] = index
    for i, spec in enumerate(specs):
        keys[spec.name] = i
        keys[i] = i
    return keys


def _shown(key: object) -> str:
    # An input or output key as a message repeats it: a name quoted and cut (a guest's
    # name can be as long as its memory), an index as it is.
    return quoted(key) if isinstance(key, str) else repr(key)


class InputChecker:
    """Validates a mapping of inputs against a graph's input specs.

    Keys may be input names or integer positions (the order of the graph's inputs).
    """

    __slots__ = ("_any_type", "_backend", "_bounds_said", "_by_key", "_fixed", "_not_inputs",
                 "_shared", "_specs")

    def __init__(
        self,
        backend: str,
        specs: Sequence[TensorSpec],
        *,
        aliases: Mapping[str, int] | None = None,
        any_type: frozenset[int] = frozenset(),
        dim_names: Mapping[str, Sequence[object]] | None = None,
        not_inputs: Mapping[str, str] | None = None,
        bounds_said: str = "allows",
    ) -> None:
        """``aliases`` are extra names for inputs (e.g. ``x`` for TensorFlow's ``x:0``);
        the shape of an input whose rank is unknown (``rank_known=False``) is not checked
        (a rank-0 input takes only a rank-0 tensor); inputs in ``any_type`` declare no
        element type: their type is not checked. A dynamic dimension must lie within the
        spec's ``bounds``, where it has them. ``dim_names``: input name -> its declared
        dimensions, where a model names them (ONNX's ``dim_param``, as
        :func:`.onnx_dims.declared_dims` reads them): the dynamic dimensions that share a
        name (a str) must be given the same size, as the ONNX standard says.
        ``not_inputs``: names the model declares that a run may not set -> what they are
        (``"an initializer ..."``), which the error for a run that sets one says.
        ``bounds_said``: how an error says where the bounds come from (the model
        ``"allows"``, torch.export's ``"was exported for"``)."""
        self._backend = backend
        self._bounds_said = bounds_said
        self._not_inputs = not_inputs or {}
        self._any_type = any_type
        self._specs = tuple(specs)
        self._by_key = _keys(self._specs, aliases)
        # (rank, ((axis, size), ...), ((axis, low, high), ...)) per input: the dims that
        # must match exactly, and the dynamic ones that must lie within bounds (none
        # in the usual case, which then costs one truth test a run).
        self._fixed = tuple(
            (len(s.shape), tuple((a, d) for a, d in enumerate(s.shape) if d is not None),
             _bounded(s))
            if s.rank_known else (-1, (), ())
            for s in self._specs
        )
        self._shared = _shared_dims(self._specs, dim_names or {})

    def check(self, inputs: Mapping[str, Tensor]) -> list[Tensor]:
        """The input tensors in the graph's input order.

        Raises InvalidArgumentError for an unknown or missing input, a wrong element type,
        rank or fixed dimension, a dynamic one outside its bounds, and dimensions of one
        name given different sizes; the message names what the model expects.
        """
        ordered: list[Tensor | None] = [None] * len(self._specs)
        by_key = self._by_key
        for key, value in inputs.items():
            index = by_key.get(key)
            if index is None:
                what = self._not_inputs.get(key) if isinstance(key, str) else None
                problem = (f"the model has no input {_shown(key)}" if what is None
                           else f"{_shown(key)} is {what}")
                raise UnknownNameError(
                    f"{self._backend}: {problem}: expected inputs {_describe_all(self._specs)}"
                )
            tensor = value if type(value) is Tensor else as_tensor(value)
            spec = self._specs[index]
            if tensor.type is not spec.type and index not in self._any_type:
                raise InvalidArgumentError(
                    f"{self._backend}: input {spec.name!r} is {tensor.type.value} but the "
                    f"model expects {spec.describe()}{_conversion_hint(tensor.type, spec.type)}"
                )
            rank, fixed, bounded = self._fixed[index]
            dims = tensor.dims
            wrong = rank >= 0 and len(dims) != rank
            if rank >= 0 and not wrong:
                for axis, size in fixed:  # a loop, not any(genexpr): once per input per run
                    if dims[axis] != size:
                        wrong = True
                        break
            if wrong:
                raise InvalidArgumentError(
                    f"{self._backend}: input {spec.name!r} has shape {list(dims)} but the "
                    f"model expects {spec.describe()}"
                )
            if bounded:
                for axis, low, high in bounded:
                    size = dims[axis]
                    if size < low or (high is not None and size > high):
                        raise out_of_bounds(self._backend, spec, axis, size, low, high,
                                            self._bounds_said)
            if ordered[index] is not None:
                raise InvalidArgumentError(
                    f"{self._backend}: input {spec.name!r} is given twice (by name and index)"
                )
            ordered[index] = tensor
        if len(inputs) != len(ordered) or None in ordered:
            missing = [s for s, t in zip(self._specs, ordered, strict=True) if t is None]
            raise InvalidArgumentError(
                f"{self._backend}: missing inputs {_describe_all(missing)}: the model expects "
                f"{_describe_all(self._specs)}"
            )
        if self._shared:
            self._check_shared(ordered)  # type: ignore[arg-type]  # no None left
        return ordered  # type: ignore[return-value]  # no None left (checked above)

    def _check_shared(self, ordered: list[Tensor]) -> None:
        """InvalidArgumentError for dimensions of one name given different sizes."""
        for name, ((first, first_axis), *others) in self._shared:
            size = ordered[first].dims[first_axis]
            for index, axis in others:
                other = ordered[index].dims[axis]
                if other != size:
                    specs = self._specs
                    where = ("it has" if index == first
                             else f"input {specs[first].name!r} has")
                    raise InvalidArgumentError(
                        f"{self._backend}: input {specs[index].name!r} has size {other} in "
                        f"dimension {axis}, but {where} size {size} in dimension "
                        f"{first_axis}, and the model names both {name!r}: expected the "
                        f"same size in both (the model expects "
                        f"{_describe_all(list(dict.fromkeys((specs[first], specs[index]))))})"
                    )


def _bounded(spec: TensorSpec) -> tuple[tuple[int, int, int | None], ...]:
    """``(axis, low, high)`` for each dynamic dimension of ``spec`` its bounds limit."""
    if not spec.bounds:
        return ()
    return tuple((axis, low, high) for axis, (size, (low, high))
                 in enumerate(zip(spec.shape, spec.bounds, strict=True))
                 if size is None and (low > 0 or high is not None))


def _shared_dims(specs: Sequence[TensorSpec], dim_names: Mapping[str, Sequence[object]]
                 ) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    """``(name, ((input, axis), ...))`` for each dimension name that ``dim_names`` gives
    more than one dynamic input dimension, in the inputs' order."""
    named: dict[str, list[tuple[int, int]]] = {}
    for index, spec in enumerate(specs):
        dims = dim_names.get(spec.name)
        if dims is None or not spec.rank_known or len(dims) != len(spec.shape):
            continue  # (nothing declared, or not what the library reports: not trusted)
        for axis, (size, dim) in enumerate(zip(spec.shape, dims, strict=True)):
            if size is None and isinstance(dim, str) and dim:
                named.setdefault(dim, []).append((index, axis))
    return tuple((name, tuple(where)) for name, where in named.items() if len(where) > 1)


class OutputSelector:
    """Resolves the ``outputs=`` argument of a run into output indices."""

    __slots__ = ("_all", "_backend", "_by_key", "_specs")

    def __init__(
        self, backend: str, specs: Sequence[TensorSpec], *, aliases: Mapping[str, int] | None = None
    ) -> None:
        self._backend = backend
        self._specs = tuple(specs)
        self._all = tuple(range(len(self._specs)))
        self._by_key = _keys(self._specs, aliases)

    def select(self, outputs: Sequence[str] | None) -> tuple[int, ...]:
        """Indices of the requested outputs (all when None), each once, in the order first
        asked for (a name and an alias of one output are one); InvalidArgumentError if
        unknown."""
        if outputs is None:
            return self._all
        if isinstance(outputs, str):
            outputs = (outputs,)
        picked = []
        for key in outputs:
            index = self._by_key.get(key)
            if index is None:
                raise UnknownNameError(
                    f"{self._backend}: the model has no output {_shown(key)}: expected outputs "
                    f"{_describe_all(self._specs)}"
                )
            if index not in picked:  # (runs, and counts, each output once)
                picked.append(index)
        return tuple(picked)


class CheckedGraph(CompiledGraph):
    """A built-in backend's graph: :meth:`run` refuses a closed graph, checks the inputs and
    resolves ``outputs=``, then hands the library's handle, the inputs in the graph's order
    and the picked output indices to the backend's :meth:`_run`.

    A template method rather than a helper each ``run`` calls: ``run`` is on every
    request, and this way the shared part costs no more frames than the backends' own
    copies did (``run``, ``check``, then ``_run`` where ``select`` was; ``select`` only
    runs when outputs are named, which the scheduler never does).
    """

    def __init__(
        self,
        backend: str,
        handle: object,
        device: Device,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        *,
        in_aliases: Mapping[str, int] | None = None,
        out_aliases: Mapping[str, int] | None = None,
        any_type: frozenset[int] = frozenset(),
        dim_names: Mapping[str, Sequence[object]] | None = None,
        not_inputs: Mapping[str, str] | None = None,
        bounds_said: str = "allows",
    ) -> None:
        """``handle`` is the library's compiled model (None once closed); the keywords go
        to :class:`InputChecker` and :class:`OutputSelector`."""
        self._backend = backend
        self._handle: Any = handle
        self.device = device
        self.inputs = inputs
        self.outputs = outputs
        self.input_aliases = MappingProxyType(dict(in_aliases or {}))
        self.output_aliases = MappingProxyType(dict(out_aliases or {}))
        self._checker = InputChecker(
            backend, inputs, aliases=in_aliases, any_type=any_type, dim_names=dim_names,
            not_inputs=not_inputs, bounds_said=bounds_said,
        )
        self._selector = OutputSelector(backend, outputs, aliases=out_aliases)
        #: What ``select(None)`` returns: the very object, so ``picked is self._all`` holds.
        self._all = self._selector.select(None)

    def run(
        self,
        inputs: Mapping[str, Tensor],
        *,
        outputs: Sequence[str] | None = None,
        keep_on_device: bool = False,
    ) -> dict[str, Tensor]:
        handle = self._handle
        if handle is None:
            handle = self._open()  # raises: the graph was closed
        ordered = self._checker.check(inputs)
        picked = self._all if outputs is None else self._selector.select(outputs)
        return self._run(handle, ordered, picked, keep_on_device)

    @abc.abstractmethod
    def _run(
        self, handle: Any, ordered: list[Tensor], picked: tuple[int, ...], keep_on_device: bool
    ) -> dict[str, Tensor]:
        """Run the library on checked inputs (in the graph's input order) and return the
        outputs at ``picked`` (indices into :attr:`outputs`), as :meth:`run` documents."""

    def _open(self) -> Any:
        """The library's handle, for the backends' accessors; ClosedResourceError once
        closed."""
        handle = self._handle
        if handle is None:
            raise ClosedResourceError(f"{self._backend}: the graph was closed")
        return handle

    def close(self) -> None:
        self._handle = None


def _conversion_hint(given: TensorType, expected: TensorType) -> str:
    """A hint for the usual mix-up: Python floats (and numpy's default) are f64."""
    if given is TensorType.F64 and expected in (TensorType.F32, TensorType.F16):
        name = "float32" if expected is TensorType.F32 else "float16"
        return (f" (Python floats and numpy's default are f64: convert with "
                f".astype(np.{name}))")
    return ""
