"""Several backends side by side, imported only when first needed.

Built-in backends are described by a :class:`BackendSpec` (its library and encodings are
known without importing anything); third-party backends plug in through the entry-point
group ``wasinn.backends`` (an entry point names a :class:`~wasinn.backends.base.Backend`
subclass). :meth:`BackendRegistry.choose` picks the backend for an (encoding, target) pair
following a preference order that a config can change, and logs why at debug level.

A backend whose module cannot be imported, or whose class cannot be made (a plugin
whose package is broken or gone), is unsupported-operation where it is asked for by
name, the error naming it and what its import raised; where backends are looked through
(:meth:`~BackendRegistry.candidates`, :meth:`~BackendRegistry.choose_name`), it is
passed over with a warning (once) naming it and why. Its import is tried once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import InvalidArgumentError, UnsupportedOperationError

from .base import Backend, BackendRef, Builders, Device

log = logging.getLogger("wasinn.backends")

ENTRY_POINT_GROUP = "wasinn.backends"

_E = GraphEncoding


@dataclass(frozen=True)
class BackendSpec:
    """What is known about a backend before importing it."""

    name: str
    entry: str  # "module:Class"
    library: str | None  # the import whose presence means "installed"; None = always
    encodings: frozenset[GraphEncoding] | None  # None = ask the backend once imported


BUILTIN: tuple[BackendSpec, ...] = (
    BackendSpec("openvino", "wasinn.backends.openvino:OpenVinoBackend", "openvino",
                frozenset({_E.OPENVINO, _E.ONNX, _E.TENSORFLOW, _E.TENSORFLOWLITE})),
    BackendSpec("onnxruntime", "wasinn.backends.onnxruntime:OnnxRuntimeBackend", "onnxruntime",
                frozenset({_E.ONNX})),
    BackendSpec("pytorch", "wasinn.backends.pytorch:TorchBackend", "torch",
                frozenset({_E.PYTORCH})),
)

#: Default preference: ONNX Runtime first for ONNX (fastest on CPU at batch 1 in our
#: measurements and the only one with a CUDA provider), then OpenVINO, then PyTorch.
DEFAULT_PREFERENCE: tuple[str, ...] = ("onnxruntime", "openvino", "pytorch")


@dataclass
class Sniffed:
    """What :meth:`BackendRegistry.sniff` found: the backend that claims a model, its
    encoding and score (``name`` None: none did), and which backends were asked, and
    which not (``skipped``: they read several encodings)."""

    name: str | None = None
    encoding: GraphEncoding | None = None
    score: float = 0.0
    asked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def unclaimed(self) -> str:
        """Says, for an error, that no backend claimed the model and which were asked
        ("" when there were none to ask)."""
        said = []
        if self.asked:
            said.append(f"nor does a plugin backend's sniff claim them (asked: "
                        f"{', '.join(self.asked)})")
        if self.skipped:
            said.append(f"{', '.join(self.skipped)} read(s) several encodings, which its "
                        "sniff cannot tell apart: declare the model's encoding")
        return "; ".join(said)


def _plugin_specs() -> list[BackendSpec]:
    specs = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        specs.append(BackendSpec(ep.name, ep.value, None, None))
    return specs


class BackendRegistry:
    """The backends this process knows, each imported and instantiated on first use."""

    def __init__(
        self,
        preference: Sequence[str] = DEFAULT_PREFERENCE,
        *,
        extra: Iterable[Backend] = (),
        discover_plugins: bool = True,
    ) -> None:
        self._specs: dict[str, BackendSpec] = {s.name: s for s in BUILTIN}
        if discover_plugins:
            for spec in _plugin_specs():
                self._specs.setdefault(spec.name, spec)
        self._instances: dict[str, Backend] = {}
        #: Why each backend that could not be imported could not, by name.
        self._unimportable: dict[str, str] = {}
        self._warned: set[str] = set()
        for backend in extra:
            self._instances[backend.name] = backend
            self._specs[backend.name] = BackendSpec(backend.name, "", None, backend.encodings)
        self._lock = threading.Lock()
        self.preference: tuple[str, ...] = tuple(preference)
        for name in self.preference:
            if name not in self._specs:
                raise InvalidArgumentError(
                    f"backend preference names unknown backend {name!r}: "
                    f"expected one of {', '.join(sorted(self._specs))}"
                )

    def names(self) -> list[str]:
        """Every backend name known, preferred ones first."""
        rest = sorted(n for n in self._specs if n not in self.preference)
        return [*self.preference, *rest]

    def is_installed(self, name: str) -> bool:
        """Whether ``name``'s library can be imported here (checked without importing it)."""
        spec = self._spec(name)
        if name in self._instances or spec.library is None:
            return True
        return importlib.util.find_spec(spec.library) is not None

    def installed(self) -> list[str]:
        return [n for n in self.names() if self.is_installed(n)]

    def get(self, name: str) -> Backend:
        """The backend instance called ``name``, importing it on first use.

        Raises InvalidArgumentError for a name no backend has; UnsupportedOperationError
        for a backend that is not installed, or whose module cannot be imported or
        whose class cannot be made (naming it and the error, the same each time)."""
        with self._lock:
            backend = self._instances.get(name)
            if backend is None:
                backend = self._instances[name] = self._import(name)
            return backend

    def _import(self, name: str) -> Backend:
        spec = self._spec(name)
        self._check_installed(name)
        why = self._unimportable.get(name)
        if why is not None:
            raise UnsupportedOperationError(why)
        try:
            module_name, _, attr = spec.entry.partition(":")
            backend: Backend = getattr(importlib.import_module(module_name), attr)()
        except Exception as exc:  # a plugin's import may raise anything
            why = self._unimportable[name] = (
                f"backend {name!r} cannot be imported (entry point {spec.entry}): "
                f"{type(exc).__name__}: {exc}")
            raise UnsupportedOperationError(why) from exc
        return backend

    def reads(self, name: str, encoding: GraphEncoding) -> bool:
        """Whether backend ``name`` reads ``encoding`` (a plugin is imported to ask).
        Raises what :meth:`get` raises."""
        spec = self._spec(name)
        encodings = spec.encodings
        if encodings is None:
            encodings = self.get(name).encodings
        return encoding in encodings

    def candidates(self, encoding: GraphEncoding) -> list[str]:
        """Installed backends that read ``encoding``, in preference order; one that
        cannot be imported is passed over (with a warning)."""
        return [n for n in self.installed()
                if self._usable(n, lambda n: self.reads(n, encoding))]

    def _usable(self, name: str, ask: Callable[[str], bool]) -> bool:
        """``ask(name)``, False where backend ``name`` cannot be imported: passed over,
        with a warning the first time."""
        try:
            return ask(name)
        except UnsupportedOperationError:
            why = self._unimportable.get(name)
            if why is None:
                raise
            self._warn_passed_over(name, why)
            return False

    def _warn_passed_over(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s: it is passed over", why)

    def choose(
        self, encoding: GraphEncoding, target: ExecutionTarget
    ) -> tuple[Backend, list[Device]]:
        """The preferred installed backend that reads ``encoding`` and has a ``target`` device.

        Returns the backend and its devices of that kind. Raises UnsupportedOperationError
        naming every backend considered and why it was passed over.
        """
        backend = self.get(self.choose_name(encoding, target))
        return backend, [d for d in backend.devices() if d.kind is target]

    def choose_name(self, encoding: GraphEncoding, target: ExecutionTarget) -> str:
        """The name of the backend :meth:`choose` picks, importing only the backends
        whose devices must be asked (never a built-in one for the CPU, on which every
        backend runs: a graph run in a process of its own is then chosen without this
        process importing its library). Raises what :meth:`choose` raises."""
        passed: list[str] = []
        for name in self.names():
            if not self.is_installed(name):
                passed.append(f"{name}: not installed")
                continue
            if not self._usable(name, lambda n: self.reads(n, encoding)):
                passed.append(self._passed_over(name, f"does not read {encoding.value}"))
                continue
            if not self._usable(name, lambda n: self.has_device(n, target)):
                passed.append(self._passed_over(name, f"no {target.value} device here"))
                continue
            log.debug(
                "chose backend %s for %s on %s (preference %s; passed over: %s)",
                name, encoding.value, target.value, list(self.names()), passed or "none",
            )
            return name
        raise UnsupportedOperationError(
            f"no backend runs {encoding.value} on {target.value}: " + "; ".join(passed)
        )

    def sniff(self, builders: Builders, target: ExecutionTarget,
              only: str | None = None) -> Sniffed:
        """Which backend that is not built in (given in code, or an entry-point plugin)
        claims ``builders`` by its :meth:`~.base.Backend.sniff`, for an autodetected model
        whose bytes match no built-in format: the highest score above 0 among those with
        a ``target`` device (``only``: that backend alone, where the model names it),
        each imported to be asked. A backend that reads several encodings is not asked:
        its score could not say which one the bytes are in (its models need their
        encoding declared). One whose sniff raises, or cannot be imported, is passed
        over with a warning."""
        found = Sniffed()
        for name in self.installed() if only is None else [only]:
            if any(self._specs.get(name) is builtin for builtin in BUILTIN):
                continue
            if not self._usable(name, lambda n: self.has_device(n, target)):
                continue
            backend = self.get(name)
            if len(backend.encodings) != 1:
                found.skipped.append(name)
                continue
            found.asked.append(name)
            try:
                score = float(backend.sniff(builders))
            except Exception as exc:  # a plugin's sniff may raise anything
                self._warn_passed_over(
                    name, f"backend {name!r}'s sniff raised {type(exc).__name__}: {exc}")
                continue
            if score > 0 and (found.name is None or score > found.score):
                found.name, found.score = name, score
                (found.encoding,) = backend.encodings
        if found.name is not None:
            log.debug("autodetect: backend %s claims the model (%s, sniff %g; asked %s)",
                      found.name, found.encoding and found.encoding.value, found.score,
                      found.asked)
        return found

    def _passed_over(self, name: str, otherwise: str) -> str:
        """Why ``name`` was passed over: it cannot be imported, or ``otherwise``."""
        why = self._unimportable.get(name)
        return f"{name}: {otherwise}" if why is None else f"{name}: {why}"

    def has_device(self, name: str, target: ExecutionTarget) -> bool:
        """Whether backend ``name`` has a ``target`` device here; imported to ask,
        unless it is a built-in one not imported yet and ``target`` is the CPU.
        UnsupportedOperationError when it is not installed."""
        spec = self._spec(name)
        if (target is ExecutionTarget.CPU and name not in self._instances
                and any(spec is builtin for builtin in BUILTIN)):
            self._check_installed(name)
            return True
        return any(d.kind is target for d in self.get(name).devices())

    def ref(self, name: str) -> BackendRef:
        """Backend ``name`` as a process of its own makes it (not imported here)."""
        backend = self._instances.get(name)
        if backend is not None:
            return BackendRef.of(backend)
        return BackendRef(name, self._spec(name).entry)

    def _check_installed(self, name: str) -> None:
        if not self.is_installed(name):
            raise UnsupportedOperationError(
                f"backend {name!r} is not installed: install wasinn[{name}]"
            )

    def _spec(self, name: str) -> BackendSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown backend {name!r}: expected one of {', '.join(sorted(self._specs))}"
            ) from None
