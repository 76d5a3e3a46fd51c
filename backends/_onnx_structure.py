"""Refusing ONNX nodes whose structure alone crashes a library as it reads the model.

Some malformed nodes kill the process that reads or builds the model, before any input
exists. A crash in a sandboxed graph's process (:mod:`.sandbox`) ends only that process,
but a model loaded in the host's (a registered model, ``rt.load`` bytes, a guest's model
with ``sandbox = false``) took the host with it. :func:`check_structure` refuses them,
with InvalidEncodingError, before either library parses the model:

- OpenVINO's ONNX frontend (2026.4) uses inputs a node does not have: a Pad of opset 11
  or later given only its data input, a Conv given only its input, a Max, Min, Mean,
  Sum, GlobalAveragePool, GlobalMaxPool or LogSoftmax given none died of SIGSEGV in
  ``read_model`` (docs/upstream/openvino_onnx_pad_without_pads.md; ONNX Runtime refuses
  them itself). Every default-domain node (domain ``""`` or ``ai.onnx``) with fewer
  inputs than ONNX requires of its operator at the opset in effect (the schema's
  ``min_input``, :data:`_REQUIRED_INPUTS`) is refused: ONNX Runtime checks the same
  count, so no model it builds is refused, and the frontend's other translators are
  not known to check it either. Empty names among them (an omitted optional input)
  count, as the libraries count them: OpenVINO refuses an empty required input cleanly.
  Of the ``com.microsoft`` operators (ONNX Runtime's), the frontend crashed the same way
  on Attention, FusedConv and Pad (:data:`_MICROSOFT_REQUIRED_INPUTS`), which are checked
  against ONNX Runtime's schemas; its other translators of that domain refused cleanly.
- ONNX Runtime (1.31) narrows DepthToSpace's int64 ``blocksize`` to 32 bits, so a
  multiple of 2^32 became a divisor of 0: SIGFPE while the session was built, where
  the input's shape is static (docs/upstream/onnxruntime_crash_on_input_shapes.md). A
  DepthToSpace or SpaceToDepth ``blocksize`` outside 1 to 2^31 - 1 is refused. That
  refuses no model that could run: blocksize² must divide the channel count
  (DepthToSpace), or blocksize both the height and the width (SpaceToDepth), so a
  larger one needs a tensor of at least 2^62 elements.

The opset in effect is the model's import of the default domain (``""`` or
``ai.onnx``, the higher where both are imported), in its graph and in every subgraph;
for a model-local function's nodes, the function's own import, else the model's. A model
that imports none is read at the latest opset, as both libraries read it. An operator
these tables do not know (another domain's, or one newer than them) is not checked.

The walk reads the bytes as :mod:`._onnx_check`'s does (:mod:`._onnx_wire`) (a field number above
protobuf's last is InvalidEncodingError, and so is nesting beyond its limit) and reads
only what it checks: each node's inputs, operator and domain, and the attributes that
may hold a subgraph (those of If, Loop and Scan, and any other whose bytes may hold a
graph's tag) or a blocksize. Weights are skipped, never copied. It visits the main graph,
every subgraph at any depth, and model-local functions; training graphs are not read by
either library and are not walked. ORT-format models (flatbuffers) are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from wasinn.errors import InvalidEncodingError

from ._onnx_wire import message_fields, onnx_values

#: ModelProto: graph, opset_import, functions.
_MODEL_GRAPH, _MODEL_OPSETS, _MODEL_FUNCTIONS = 7, 8, 25
#: GraphProto.node; FunctionProto: node, opset_import, name.
_GRAPH_NODE, _FUNCTION_NODE, _FUNCTION_OPSETS, _FUNCTION_NAME = 1, 7, 9, 1
#: NodeProto: input, name, op_type, attribute, domain.
_INPUT, _NAME, _OP_TYPE, _ATTRIBUTE, _DOMAIN = 1, 3, 4, 5, 7
#: AttributeProto: name, i, g, graphs.
_ATTRIBUTE_NAME, _ATTRIBUTE_INT, _ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS = 1, 3, 6, 11
#: OperatorSetIdProto: domain, version.
_OPSET_DOMAIN, _OPSET_VERSION = 1, 2
#: Protobuf's parsers refuse messages nested deeper than this; a subgraph is 3 levels
#: below the graph that holds it (node, attribute, graph).
_DEPTH = 100
_DEFAULT_DOMAINS = frozenset({b"", b"ai.onnx"})
#: The opset of a model that imports no default-domain one: the libraries' latest.
LATEST = 2**63 - 1
#: Attribute bytes up to this size are searched for a graph field's tag before they are
#: walked; larger ones (a tensor's, mostly raw data) are walked, a few fields each.
_SEARCHED = 4096
#: The first byte of the tag of AttributeProto.g or .graphs, however the tag is encoded.
_GRAPH_TAGS = re.compile(rb"[\x32\xb2\x5a\xda]")
#: The operators whose attributes hold subgraphs by their definitions.
_CONTROL_FLOW = frozenset({b"If", b"Loop", b"Scan"})
#: The operators whose ``blocksize`` is checked, and the largest one accepted.
_BLOCKSIZE_OPS = frozenset({b"DepthToSpace", b"SpaceToDepth"})
MAX_BLOCKSIZE = 2**31 - 1


def _steady(count: int, names: str) -> dict[str, tuple[tuple[int, int], ...]]:
    return {name: ((1, count),) for name in names.split()}


#: The inputs ONNX requires of each default-domain operator (its schema's
#: ``min_input``): (first opset, count) from each opset on where the count changed
#: (onnx 1.23's schemas; ``tests/test_onnx_structure.py`` compares them with the
#: installed onnx's).
_REQUIRED_INPUTS: dict[str, tuple[tuple[int, int], ...]] = {
    **_steady(0, "Constant Optional RandomNormal RandomUniform SequenceEmpty"),
    **_steady(1, """
        Abs Acos Acosh ArgMax ArgMin Asin Asinh Atan Atanh AveragePool Bernoulli BitCast
        BitwiseNot BlackmanWindow Cast Ceil Celu Clip Concat ConcatFromSequence
        ConstantOfShape Cos Cosh DFT DepthToSpace Det Dropout DynamicQuantizeLinear Einsum
        Elu Erf Exp EyeLike Flatten Floor Gelu GlobalAveragePool GlobalLpPool GlobalMaxPool
        HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageDecoder
        IsInf IsNaN LRN LeakyRelu Log LogSoftmax LpNormalization LpPool Max MaxPool Mean
        MeanVarianceNormalization Min Mish Multinomial Neg NonZero Not OptionalGetElement
        RandomNormalLike RandomUniformLike Reciprocal ReduceL1 ReduceL2 ReduceLogSum
        ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare
        RegexFullMatch Relu Round Selu SequenceConstruct SequenceErase SequenceLength
        SequenceMap Shape Shrink Sigmoid Sign Sin Sinh Size Softmax Softplus Softsign
        SpaceToDepth Split SplitToSequence Sqrt Squeeze StringNormalizer StringSplit Sum
        Swish Tan Tanh TfIdfVectorizer ThresholdedRelu Transpose Trilu Unique"""),
    **_steady(2, """
        Add AffineGrid And BitShift BitwiseAnd BitwiseOr BitwiseXor CastLike
        CausalConvWithState CenterCropPad Compress Conv ConvInteger ConvTranspose CumProd
        CumSum DequantizeLinear Div Equal Expand Gather GatherElements GatherND Greater
        GreaterOrEqual GridSample LayerNormalization Less LessOrEqual MatMul MatMulInteger
        MaxRoiPool MaxUnpool Mod Mul NegativeLogLikelihoodLoss NonMaxSuppression Or PRelu
        Pow QuantizeLinear RMSNormalization ReverseSequence STFT SequenceAt SequenceInsert
        SoftmaxCrossEntropyLoss StringConcat Sub SwiGLU TensorScatter Xor"""),
    **_steady(3, """
        Attention Col2Im DeformConv GRU GroupNormalization InstanceNormalization LSTM
        LinearAttention OneHot RNN Range RoiAlign RotaryEmbedding Scatter ScatterElements
        ScatterND Where"""),
    **_steady(5, "BatchNormalization MelWeightMatrix"),
    **_steady(8, "QLinearConv QLinearMatMul"),
    "Gemm": ((1, 3), (11, 2)),
    "Loop": ((1, 3), (11, 2)),
    "OptionalHasElement": ((15, 1), (18, 0)),
    "Pad": ((1, 1), (11, 2)),
    "Reshape": ((1, 1), (5, 2)),
    "Resize": ((10, 2), (11, 3), (13, 1)),
    "Scan": ((8, 2), (9, 1)),
    "Slice": ((1, 1), (10, 3)),
    "Tile": ((1, 3), (6, 2)),
    "TopK": ((1, 1), (10, 2)),
    "Unsqueeze": ((1, 1), (13, 2)),
    "Upsample": ((1, 1), (9, 2)),
}


#: The ``com.microsoft`` operators whose translators in OpenVINO's ONNX frontend crashed
#: (SIGSEGV) on a node with fewer inputs than ONNX Runtime's schema requires, of the 136
#: in onnxruntime 1.31 each tried with none and with one fewer: the inputs it requires.
_MICROSOFT_REQUIRED_INPUTS = {b"Attention": 2, b"FusedConv": 2, b"Pad": 2}
_MICROSOFT = b"com.microsoft"


def required_inputs(op_type: str, opset: int) -> int | None:
    """How many inputs ONNX requires of the default-domain operator ``op_type`` at
    ``opset`` (:data:`LATEST`: the newest), or None where the table does not know it
    there."""
    required = None
    for since, count in _REQUIRED_INPUTS.get(op_type, ()):
        if since <= opset:
            required = count
    return required


def check_structure(backend: str, data: bytes | bytearray | memoryview) -> None:
    """Raise InvalidEncodingError, naming ``backend``, the node and what is expected,
    for the first node of the ONNX model ``data`` whose structure alone crashed a
    library reading it (see the module docstring), or for bytes the walk cannot read
    (not protobuf, a field number above protobuf's last, nesting beyond its limit)."""
    view = memoryview(data).cast("B")
    try:
        problem = _first_problem(view)
    except ValueError as exc:
        raise InvalidEncodingError(
            f"{backend}: cannot read the ONNX model: not a well-formed protobuf ({exc})"
        ) from exc
    if problem is not None:
        raise InvalidEncodingError(f"{backend}: cannot read the ONNX model: {problem}")


class _Nodes:
    """A list of nodes still to visit: the rest of its message's fields, the field that
    holds nodes, the opset in effect there, where it is (for messages), the message's
    nesting level, and how many nodes were visited."""

    __slots__ = ("fields", "level", "node_field", "opset", "visited", "where")

    def __init__(self, view: memoryview, start: int, end: int, node_field: int,
                 opset: int, where: str, level: int) -> None:
        self.fields = message_fields(view, start, end)
        self.node_field, self.opset, self.where, self.level = node_field, opset, where, level
        self.visited = 0

    def label(self, node: _Node) -> str:
        """How a message names ``node``, the last one visited."""
        return repr(_text(node.name)) if node.name else f"#{self.visited - 1} of {self.where}"


def _first_problem(view: memoryview) -> str | None:
    """What is wrong with the first node that fails a check, or None. ValueError for
    bytes the walk cannot read."""
    graphs, functions, imports = [], [], []
    for number, start, end in message_fields(view, 0, len(view)):
        if number == _MODEL_GRAPH:
            graphs.append((start, end))  # (several: protobuf merges them into one)
        elif number == _MODEL_FUNCTIONS:
            functions.append((start, end))
        elif number == _MODEL_OPSETS:
            imports.append((start, end))
    opset = _default_opset(view, imports, LATEST)
    stack = [_Nodes(view, start, end, _GRAPH_NODE, opset, "the main graph", 2)
             for start, end in graphs]
    for start, end in functions:
        own, name = [], b""
        for number, first, last in message_fields(view, start, end):
            if number == _FUNCTION_OPSETS:
                own.append((first, last))
            elif number == _FUNCTION_NAME:
                name = bytes(view[first:last])
        stack.append(_Nodes(view, start, end, _FUNCTION_NODE, _default_opset(view, own, opset),
                            f"function {_text(name)!r}", 2))
    stack.reverse()  # the main graph first
    while stack:
        nodes = stack[-1]
        node_field = nodes.node_field
        for number, start, end in nodes.fields:
            if number != node_field:
                continue
            nodes.visited += 1
            if start == end:
                continue  # an empty node: no operator
            node = _Node(view, start, end)
            problem = node.problem(nodes.opset)
            if problem is not None:
                return f"node {nodes.label(node)} {problem}"
            subgraphs = list(node.subgraphs()) if node.attributes else []
            if not subgraphs:
                continue
            level = nodes.level + 3  # (node, attribute, graph)
            if level > _DEPTH:
                raise ValueError(f"messages nested deeper than protobuf's {_DEPTH}")
            label = nodes.label(node)
            for attribute, first, last in reversed(subgraphs):
                stack.append(_Nodes(view, first, last, _GRAPH_NODE, nodes.opset,
                                    f"attribute {_text(attribute)!r} of node {label}", level))
            break
        else:
            stack.pop()
    return None


def _default_opset(view: memoryview, imports: list[tuple[int, int]], otherwise: int) -> int:
    """The default domain's opset among the OperatorSetIdProto ``imports`` (their
    places in ``view``; the highest where several import it), else ``otherwise``."""
    versions = []
    for start, end in imports:
        domain, version = b"", 0
        for number, wire, value in onnx_values(view[start:end]):
            if number == _OPSET_DOMAIN and isinstance(value, memoryview):
                domain = bytes(value)
            elif number == _OPSET_VERSION and wire == 0 and isinstance(value, int):
                version = _int64(value)
        if domain in _DEFAULT_DOMAINS:
            versions.append(version)
    return max(versions) if versions else otherwise


class _Node:
    """The parts of one NodeProto the checks read (of a singular field given more than
    once, the last, as protobuf reads it; fields of another wire type than theirs are
    unknown ones to the libraries and skipped)."""

    __slots__ = ("_view", "attributes", "domain", "inputs", "name", "op_type")

    def __init__(self, view: memoryview, start: int, end: int) -> None:
        self.inputs = 0
        self.name = self.op_type = self.domain = b""
        self.attributes: list[tuple[int, int]] = []  # (their places in the model)
        self._view = view
        for number, first, last in message_fields(view, start, end):
            if number == _INPUT:
                self.inputs += 1
            elif number == _OP_TYPE:
                self.op_type = bytes(view[first:last])
            elif number == _DOMAIN:
                self.domain = bytes(view[first:last])
            elif number == _NAME:
                self.name = bytes(view[first:last])
            elif number == _ATTRIBUTE:
                self.attributes.append((first, last))

    def problem(self, opset: int) -> str | None:
        """What is wrong with this node at ``opset`` (the words after its name), or None."""
        if self.domain == _MICROSOFT:
            return self._missing(_MICROSOFT_REQUIRED_INPUTS.get(self.op_type),
                                 "ONNX Runtime's com.microsoft domain requires of")
        if self.domain not in _DEFAULT_DOMAINS:
            return None
        at = "the latest opset (the model imports none)" if opset == LATEST else f"opset {opset}"
        missing = self._missing(_required(self.op_type, opset), "ONNX requires of", f" at {at}")
        if missing is not None:
            return missing
        if self.op_type in _BLOCKSIZE_OPS:
            for blocksize in self._blocksizes():
                if not 1 <= blocksize <= MAX_BLOCKSIZE:
                    return (f"({_text(self.op_type)}) has blocksize {blocksize}: expected "
                            f"1 to {MAX_BLOCKSIZE:,} (2**31 - 1; a larger one fits no tensor)")
        return None

    def _missing(self, required: int | None, who: str, at: str = "") -> str | None:
        """What is wrong if this node has fewer inputs than ``required``, which ``who``
        requires of its operator (``at``: where), else None."""
        if required is None or self.inputs >= required:
            return None
        op = _text(self.op_type)
        return (f"({op}) has {self.inputs} input{'s' if self.inputs != 1 else ''}: "
                f"expected at least {required}, the inputs {who} {op}{at}")

    def _blocksizes(self) -> Iterator[int]:
        """The value of each ``blocksize`` attribute that has one."""
        for start, end in self.attributes:
            name, value = b"", None
            for number, wire, field in onnx_values(self._view[start:end]):
                if number == _ATTRIBUTE_NAME and isinstance(field, memoryview):
                    name = bytes(field)
                elif number == _ATTRIBUTE_INT and wire == 0 and isinstance(field, int):
                    value = _int64(field)
            if name == b"blocksize" and value is not None:
                yield value

    def subgraphs(self) -> Iterator[tuple[bytes, int, int]]:
        """(attribute name, start, end in the model) of each graph this node's
        attributes hold."""
        view = self._view
        for start, end in self.attributes:
            if (self.op_type not in _CONTROL_FLOW and end - start <= _SEARCHED
                    and not _GRAPH_TAGS.search(view, start, end)):
                continue  # no byte that could start a graph field's tag
            name, graphs = b"", []
            for number, first, last in message_fields(view, start, end):
                if number == _ATTRIBUTE_NAME:
                    name = bytes(view[first:last])
                elif number in (_ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS):
                    graphs.append((first, last))
            for first, last in graphs:
                yield name, first, last


def _required(op_type: bytes, opset: int) -> int | None:
    """:func:`required_inputs` of an operator's name as the bytes hold it."""
    try:
        return required_inputs(op_type.decode(), opset)
    except UnicodeDecodeError:
        return None


def _int64(varint: int) -> int:
    """A varint as protobuf reads an int64: its low 64 bits, two's complement."""
    varint &= 2**64 - 1
    return varint - 2**64 if varint >= 2**63 else varint


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")[:200]
