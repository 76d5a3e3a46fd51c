"""Input checking and output selection shared by the built-in backends.

Every backend validates a run's inputs against its graph's :class:`TensorSpec` s before
calling its library, so a wrong name, element type or shape is an InvalidArgumentError
that says what the model expects instead of a library message. The checks are
precomputed per graph so that they cost a few dictionary lookups per run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from wasinn.errors import InvalidArgumentError, InvalidEncodingError
from wasinn.tensor import Tensor, as_tensor

from .base import Builders, TensorSpec


def expect_builders(backend: str, builders: Builders, count: int, what: str) -> None:
    """InvalidEncodingError unless there are exactly ``count`` non-empty builders."""
    if len(builders) == 0:
        raise InvalidEncodingError(f"{backend}: empty builder list: expected {what}")
    if len(builders) != count:
        raise InvalidEncodingError(
            f"{backend}: {len(builders)} builders given but {what} is expected"
        )
    for i, b in enumerate(builders):
        if memoryview(b).nbytes == 0 and not (count == 2 and i == 1):
            raise InvalidEncodingError(f"{backend}: builder {i} is empty: expected {what}")


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


class InputChecker:
    """Validates a mapping of inputs against a graph's input specs.

    Keys may be input names or integer positions (the order of the graph's inputs).
    """

    __slots__ = ("_any_type", "_backend", "_by_key", "_fixed", "_specs")

    def __init__(
        self,
        backend: str,
        specs: Sequence[TensorSpec],
        *,
        aliases: Mapping[str, int] | None = None,
        any_rank: frozenset[int] = frozenset(),
        any_type: frozenset[int] = frozenset(),
    ) -> None:
        """``aliases`` are extra names for inputs (e.g. ``x`` for TensorFlow's ``x:0``);
        inputs in ``any_rank`` have a dynamic rank: their shape is not checked; inputs in
        ``any_type`` declare no element type: their type is not checked."""
        self._backend = backend
        self._any_type = any_type
        self._specs = tuple(specs)
        self._by_key = _keys(self._specs, aliases)
        # (rank, ((axis, size), ...)) per input: the dims that must match exactly.
        self._fixed = tuple(
            (-1, ()) if i in any_rank
            else (len(s.shape), tuple((a, d) for a, d in enumerate(s.shape) if d is not None))
            for i, s in enumerate(self._specs)
        )

    def check(self, inputs: Mapping[str, Tensor]) -> list[Tensor]:
        """The input tensors in the graph's input order.

        Raises InvalidArgumentError for an unknown or missing input, a wrong element type,
        rank or fixed dimension; the message names what the model expects.
        """
        ordered: list[Tensor | None] = [None] * len(self._specs)
        by_key = self._by_key
        for key, value in inputs.items():
            index = by_key.get(key)
            if index is None:
                raise InvalidArgumentError(
                    f"{self._backend}: the model has no input {key!r}: expected inputs "
                    f"{_describe_all(self._specs)}"
                )
            tensor = value if type(value) is Tensor else as_tensor(value)
            spec = self._specs[index]
            if tensor.type is not spec.type and index not in self._any_type:
                raise InvalidArgumentError(
                    f"{self._backend}: input {spec.name!r} is {tensor.type.value} but the "
                    f"model expects {spec.describe()}"
                )
            rank, fixed = self._fixed[index]
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
        return ordered  # type: ignore[return-value]  # no None left (checked above)


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
        """Indices of the requested outputs (all when None); InvalidArgumentError if unknown."""
        if outputs is None:
            return self._all
        if isinstance(outputs, str):
            outputs = (outputs,)
        picked = []
        for key in outputs:
            index = self._by_key.get(key)
            if index is None:
                raise InvalidArgumentError(
                    f"{self._backend}: the model has no output {key!r}: expected outputs "
                    f"{_describe_all(self._specs)}"
                )
            picked.append(index)
        return tuple(picked)
