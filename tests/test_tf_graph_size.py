"""Long TensorFlow GraphDefs: wasinn's own part of a load stays linear in the nodes.

Loading a chain of N Relu nodes through the OpenVINO backend grows faster than N^2 (1,000
nodes 3 s, 2,000 14 s, 3,000 37 s here): all of it is OpenVINO's CPU compile, whatever
the encoding (its snippets tokenization clones the fused subgraph once per node; see the
README's "Models from guests"). wasinn's checks before OpenVINO (2 ms for 2,000 nodes)
and the child that reads the GraphDef (0.5 s) are linear; these tests count what the
checks walk, so that a per-node check that walks the message again cannot slip in, and
load a long chain end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.support import require_backend
from tests.tfmodels import relu_chain
from wasinn import GraphEncoding, Tensor
from wasinn.backends import Device, formats

pytestmark = pytest.mark.usefixtures("_openvino")


@pytest.fixture
def _openvino() -> None:
    require_backend("openvino")


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """From now on, counts the protobuf fields :mod:`wasinn.backends.formats` walks
    (``fields``) and the varints it reads past the one-byte fast path (``varints``)."""
    counts = {"fields": 0, "varints": 0}
    values, read_varint = formats.protobuf_values, formats.read_varint

    def counted_values(*args: Any) -> Iterator[Any]:
        for item in values(*args):
            counts["fields"] += 1
            yield item

    def counted_varint(*args: Any) -> tuple[int, int]:
        counts["varints"] += 1
        return read_varint(*args)

    monkeypatch.setattr(formats, "protobuf_values", counted_values)
    monkeypatch.setattr(formats, "read_varint", counted_varint)
    return counts


@pytest.mark.parametrize("length", [250, 2000, 2 * formats.SNIFF_FIELDS])
def test_the_checks_before_openvino_walk_each_node_at_most_twice(
        monkeypatch: pytest.MonkeyPatch, length: int) -> None:
    from wasinn.backends import _ovread

    handed: list[dict[str, Any]] = []

    def read_files(core: Any, files: dict[str, Any], main: str) -> tuple[Any, object]:
        handed.append(files)  # where OpenVINO would start: the checks are over
        return None, None

    monkeypatch.setattr(_ovread, "_read_files", read_files)
    model = relu_chain(length)
    counts = _counting(monkeypatch)
    _ovread.read_model(None, [model], GraphEncoding.TENSORFLOW)
    assert [list(files) for files in handed] == [["model.pb"]]
    # Sniffing the declared encoding (at most SNIFF_FIELDS) and telling a GraphDef from
    # a SavedModel (every field): each of the length + 3 fields at most twice, each field
    # read in constant work, so the checks are linear in the nodes.
    fields = length + 3
    assert counts["fields"] <= 2 * fields
    assert counts["varints"] <= 2 * counts["fields"]


def test_a_long_relu_chain_graphdef_loads_and_runs() -> None:
    from wasinn.backends._ovread import read_model
    from wasinn.backends.openvino import OpenVinoBackend

    backend = OpenVinoBackend()
    model = relu_chain(200)
    ov_model, _ = read_model(backend.core, [model], GraphEncoding.TENSORFLOW)
    assert sum(op.get_type_name() == "Relu" for op in ov_model.get_ops()) == 200
    graph = backend.load([model], GraphEncoding.TENSORFLOW, Device.parse("cpu"))
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    out = graph.run({"x:0": Tensor.from_numpy(x)})
    np.testing.assert_array_equal(out["y:0"].numpy(), np.maximum(x, 0))
