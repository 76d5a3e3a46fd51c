"""Loading a TorchScript archive as a :class:`~._torch_graph.TorchGraph` (for
:mod:`wasinn.backends.pytorch`).

Its code is checked before ``torch.jit.load`` runs any of it, its operators and integer
divisions after; its specs come from ``forward``'s signature (Tensor arguments first,
of undeclared element type and rank: TorchScript records neither); on the CPU it is
frozen and optimized for inference where torch can; its loops get stop checks where
torch can put them in, the iterations of those that freezing unrolled included. A
``torch.save`` checkpoint is refused before torch reads it.

``torch.jit.load`` holds the GIL throughout, which stops every thread of the process, the
trio loop that serves every other request included. Given bytes (a ``BytesIO``), it
copies them twice before it reads them (into a ``std::string``, then an
``istringstream``); given a file, it reads the file once. So it is given a private file
in memory (:func:`~._model_pipe.memory_file`): measured on a 2-core machine,
``torch.jit.load`` of a model with 64 / 256 MB of weights stops every thread 45-50 /
150-170 ms instead of 135-195 / 440-470 ms, and its memory peaks at one copy of the
model fewer (256 MB: 512 MiB above the bytes held, the file's pages included, against
768 MiB). What remains is torch's own reading of the weights into its tensors, which no
way of giving the archive shortens (a pipe cannot be read: torch's zip reader seeks;
``map_location`` makes no difference, ``"meta"`` included: torch reads every record
all the same). A sandbox process keeps the ``BytesIO``: its stall holds up only its own
graph, and its confinement need not allow the file's path.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import torch

from wasinn.enums import ExecutionTarget, TensorType
from wasinn.errors import InvalidEncodingError, UnsupportedOperationError

from ._model_pipe import memory_file
from ._torch_cancel import LoopSources, _with_stop_checks
from ._torch_division import check_folded_divisions, guard_torchscript_divisions
from ._torch_graph import NAME, TorchGraph, _first_line, _output_names
from ._torch_memory import script_keeps_tensors, script_storages, script_written_inputs
from ._torch_ops import check_torchscript_code, check_torchscript_module
from .base import Device, TensorSpec, in_sandbox, log
from .formats import check_not_torch_save


def _undeclared(name: str) -> TensorSpec:
    """A TorchScript tensor's spec: of undeclared element type (the f32 is a placeholder)
    and of unknown rank."""
    return TensorSpec(name, TensorType.F32, (), rank_known=False, type_known=False)


@contextlib.contextmanager
def _archive(data: bytes) -> Iterator[str | io.BytesIO]:
    """What ``torch.jit.load`` is given (see the module's docstring): the path of a private
    file in memory holding ``data``, or where there is none, or in a sandbox process, a
    ``BytesIO`` over it."""
    if in_sandbox():
        yield io.BytesIO(data)
        return
    with memory_file(data, "wasinn-torchscript") as path:
        yield io.BytesIO(data) if path is None else path


def _load_torchscript(
    data: bytes, device: Device, torch_device: torch.device, *, optimize: bool,
    interruptible: bool
) -> TorchGraph:
    # torch's reader would call a torch.save checkpoint a corrupted archive.
    check_not_torch_save(NAME, data)
    sources = check_torchscript_code(NAME, data)  # before torch.jit.load runs __setstate__
    # Before torch.jit.load folds them as it compiles; a sandbox process risks the fold.
    check_folded_divisions(NAME, sources, refuse_unguardable=not in_sandbox())
    try:
        with _archive(data) as archive:
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                archive, map_location=torch_device
            ).eval()
        schema = module.forward.schema
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the TorchScript archive: {_first_line(exc)}"
        ) from exc
    check_torchscript_module(NAME, module)
    guard_torchscript_divisions(module)  # before freezing folds a division by a constant 0
    inputs = []
    defaulted = None  # the first argument left to its default
    for arg in schema.arguments[1:]:  # [0] is self
        if str(arg.type) != "Tensor":
            if arg.has_default_value():
                defaulted = defaulted or arg
                continue
            raise UnsupportedOperationError(
                f"{NAME}: forward() argument {arg.name!r} is {arg.type}: expected Tensor "
                "arguments (others need a default value)"
            )
        if defaulted is not None:
            # A run passes its tensors by position: this one would land in that argument.
            raise UnsupportedOperationError(
                f"{NAME}: forward() argument {arg.name!r} (Tensor) follows {defaulted.name!r} "
                f"({defaulted.type}, left to its default): expected the Tensor arguments "
                "first, the others after them"
            )
        inputs.append(_undeclared(arg.name))
    returns = str(schema.returns[0].type) if schema.returns else "None"
    if returns == "Tensor":
        count = 1
    elif returns.startswith("Tuple[") and all(
        part.strip() == "Tensor" for part in returns[6:-1].split(",")
    ):
        count = len(returns[6:-1].split(","))
    else:
        raise UnsupportedOperationError(
            f"{NAME}: forward() returns {returns}: expected a Tensor or a tuple of Tensors"
        )
    outputs = tuple(map(_undeclared, _output_names(count)))
    loaded_loops = None
    if optimize and device.kind is ExecutionTarget.CPU:
        # A module that cannot be frozen (e.g. it mutates attributes) still runs as loaded,
        # as does one whose loops cannot be read (freezing would unroll them unchecked).
        with contextlib.suppress(Exception):
            loops = LoopSources(module)  # before freezing unrolls the short loops
            module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
            loaded_loops = loops
    stop_checked = None
    try:
        stop_checked, unchecked = _with_stop_checks(module, len(inputs), loaded_loops)
    except Exception as exc:  # a graph torch cannot edit still runs, as loaded
        log.warning("%s: no stop checks could be put into the loops of this TorchScript "
                    "model (%s: %s): a cancelled run of it goes on to its end", NAME,
                    type(exc).__name__, exc)
    else:
        if unchecked:
            log.warning("%s: freezing unrolled %d loop(s) of this TorchScript model (%s) "
                        "and no stop check could be put between their iterations: a "
                        "cancelled run of it goes on through them (options = { optimize = "
                        "false } keeps its loops)", NAME, len(unchecked), "; ".join(unchecked))
    return TorchGraph(module, device, tuple(inputs), outputs, checked=False,
                      private=script_written_inputs(module),
                      model_storages=script_storages(module),
                      checkpoints=interruptible, stop_checked=stop_checked,
                      stateful=script_keeps_tensors(module))
