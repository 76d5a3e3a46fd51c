"""The backend registry: preference order, lazy imports, plugins through entry points.

Fakes appear only where routing is under test (a backend that records what it is asked).
"""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import require_backend
from wasinn import (
    ExecutionTarget,
    GraphEncoding,
    InvalidArgumentError,
    Tensor,
    UnsupportedOperationError,
)
from wasinn.backends import Backend, BackendRegistry, Builders, CompiledGraph, Device, LoadOptions

CPU, GPU = ExecutionTarget.CPU, ExecutionTarget.GPU


class RoutingBackend(Backend):
    """Reads ggml on cpu and gpu:0, gpu:1; compiles nothing."""

    name = "routing"
    encodings = frozenset({GraphEncoding.GGML, GraphEncoding.ONNX})

    def devices(self) -> list[Device]:
        return [Device(CPU), Device(GPU, 0), Device(GPU, 1)]

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CompiledGraph:
        raise UnsupportedOperationError("routing backend compiles nothing")


def test_default_preference_picks_onnxruntime_for_onnx() -> None:
    require_backend("onnxruntime")
    backend, devices = BackendRegistry(discover_plugins=False).choose(GraphEncoding.ONNX, CPU)
    assert backend.name == "onnxruntime" and devices == [Device(CPU)]


def test_preference_order_changes_the_choice(caplog: pytest.LogCaptureFixture) -> None:
    require_backend("onnxruntime")
    require_backend("openvino")
    registry = BackendRegistry(("openvino", "onnxruntime", "pytorch"), discover_plugins=False)
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        backend, _ = registry.choose(GraphEncoding.ONNX, CPU)
    assert backend.name == "openvino"
    (record,) = [r for r in caplog.records if r.name == "wasinn.backends"]
    assert record.levelno == logging.DEBUG
    assert "chose backend openvino for onnx on cpu" in record.getMessage()
    assert "'openvino', 'onnxruntime', 'pytorch'" in record.getMessage()


def test_each_encoding_goes_to_the_backend_that_reads_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for lib in ("onnxruntime", "openvino", "torch"):
        require_backend(lib)
    registry = BackendRegistry(discover_plugins=False)
    expected = {
        GraphEncoding.OPENVINO: "openvino",
        GraphEncoding.TENSORFLOW: "openvino",
        GraphEncoding.TENSORFLOWLITE: "openvino",
        GraphEncoding.PYTORCH: "pytorch",
    }
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        for encoding, name in expected.items():
            assert registry.choose(encoding, CPU)[0].name == name
    # The reason names what was passed over: onnxruntime does not read pytorch.
    assert any("onnxruntime: does not read pytorch" in r.getMessage() for r in caplog.records)


def test_nothing_reads_ggml_says_why_for_each_backend() -> None:
    registry = BackendRegistry(discover_plugins=False)
    with pytest.raises(UnsupportedOperationError, match="no backend runs ggml on cpu") as info:
        registry.choose(GraphEncoding.GGML, CPU)
    for name in ("onnxruntime", "openvino", "pytorch"):
        assert name in str(info.value)


def test_a_target_without_devices_is_unsupported() -> None:
    require_backend("onnxruntime")
    registry = BackendRegistry(("onnxruntime",), discover_plugins=False)
    if any(d.kind is ExecutionTarget.TPU for d in registry.get("onnxruntime").devices()):
        pytest.skip("this machine has a TPU for onnxruntime")
    with pytest.raises(UnsupportedOperationError, match="onnxruntime: no tpu device here"):
        registry.choose(GraphEncoding.ONNX, ExecutionTarget.TPU)


def test_extra_backends_join_and_can_be_preferred() -> None:
    routing = RoutingBackend()
    registry = BackendRegistry(("routing", "onnxruntime"), extra=[routing],
                               discover_plugins=False)
    assert registry.names()[0] == "routing" and registry.is_installed("routing")
    backend, devices = registry.choose(GraphEncoding.GGML, GPU)
    assert backend is routing and devices == [Device(GPU, 0), Device(GPU, 1)]
    assert registry.choose(GraphEncoding.ONNX, CPU)[0] is routing


def test_unknown_backend_names_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown backend 'nope'"):
        BackendRegistry(("nope",), discover_plugins=False)
    with pytest.raises(InvalidArgumentError, match=r"expected one of .*onnxruntime"):
        BackendRegistry(discover_plugins=False).get("nope")


def test_entry_points_plug_in_third_party_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = importlib.metadata.EntryPoint(
        name="routing", value=f"{__name__}:RoutingBackend", group="wasinn.backends")
    asked: list[str | None] = []

    def entry_points(*, group: str | None = None) -> importlib.metadata.EntryPoints:
        asked.append(group)
        return importlib.metadata.EntryPoints([plugin] if group == "wasinn.backends" else [])

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    registry = BackendRegistry()
    assert asked == ["wasinn.backends"]
    assert "routing" in registry.names() and registry.is_installed("routing")
    backend = registry.get("routing")
    assert type(backend).__name__ == "RoutingBackend"
    assert registry.reads("routing", GraphEncoding.GGML)  # encodings asked once imported
    assert registry.choose(GraphEncoding.GGML, CPU)[0] is backend
    assert "routing" not in BackendRegistry(discover_plugins=False).names()


def test_a_config_may_name_an_entry_point_backend(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    from wasinn.configs import ConfigError
    from wasinn.configs.loader import known_backends, load_config

    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\nbackends = ["routing", "onnxruntime"]\n'
                    '[models.m]\nfiles = ["m.bin"]\nbackend = "routing"\n'
                    'options = { routing_option = 1 }\n')
    assert "routing" not in known_backends()
    with pytest.raises(ConfigError, match=r"pools\.cpu\.backends\[0\]: unknown backend "
                                          r"'routing': expected one of onnxruntime, openvino, "
                                          r"pytorch$"):
        load_config(path)
    plugin = importlib.metadata.EntryPoint(
        name="routing", value=f"{__name__}:RoutingBackend", group="wasinn.backends")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group=None: importlib.metadata.EntryPoints([plugin]))
    assert known_backends() == ["onnxruntime", "openvino", "pytorch", "routing"]
    config = load_config(path)  # nothing imported to know the name
    assert config.pools["cpu"].backends == ["routing", "onnxruntime"]
    assert config.models["m"].options == {"routing_option": 1}


def test_a_plugin_cannot_shadow_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    shadow = importlib.metadata.EntryPoint(
        name="onnxruntime", value=f"{__name__}:RoutingBackend", group="wasinn.backends")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group=None: importlib.metadata.EntryPoints([shadow]))
    spec = BackendRegistry()._spec("onnxruntime")
    assert spec.entry == "wasinn.backends.onnxruntime:OnnxRuntimeBackend"


def _chosen_in_a_fresh_interpreter(choose: str) -> list[str]:
    """What ``choose`` (Python, with a BackendRegistry ``r`` and the names ``E``
    (GraphEncoding) and ``CPU``) prints, then the libraries it imported."""
    code = (
        "import sys; from wasinn.backends import BackendRegistry;"
        "from wasinn import GraphEncoding as E, ExecutionTarget;"
        f"CPU = ExecutionTarget.CPU; r = BackendRegistry(); r.installed(); {choose};"
        "print([m for m in ('onnxruntime', 'openvino', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_only_the_chosen_backend_is_imported() -> None:
    require_backend("openvino")
    chosen = _chosen_in_a_fresh_interpreter("print(r.choose(E.TENSORFLOWLITE, CPU)[0].name)")
    assert chosen == ["openvino", "['openvino']"]


def test_choosing_a_builtin_backend_for_the_cpu_imports_nothing() -> None:
    # What a sandboxed graph needs: its backend's name and module:Class, not its library.
    require_backend("torch")
    chosen = _chosen_in_a_fresh_interpreter(
        "name = r.choose_name(E.PYTORCH, CPU); print(name, r.ref(name).entry)")
    assert chosen == ["pytorch", "wasinn.backends.pytorch:TorchBackend", "[]"]


def test_a_backend_that_is_not_installed_is_said_so_without_an_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = BackendRegistry(discover_plugins=False)
    monkeypatch.setattr(registry, "is_installed", lambda name: name != "pytorch")
    said = r"^backend 'pytorch' is not installed: install wasinn\[pytorch\]$"
    for ask in (lambda: registry.has_device("pytorch", CPU), lambda: registry.get("pytorch")):
        with pytest.raises(UnsupportedOperationError, match=said):
            ask()
    assert registry.ref("pytorch").entry == "wasinn.backends.pytorch:TorchBackend"


class BrokenBackend(RoutingBackend):
    """A plugin whose class cannot be made (its library failed to start)."""

    def __init__(self) -> None:
        raise RuntimeError("libroute.so: cannot open shared object file")


def _with_plugins(monkeypatch: pytest.MonkeyPatch, **entries: str) -> None:
    """Entry points of the group ``wasinn.backends``: name -> ``module:Class``."""
    plugins = [importlib.metadata.EntryPoint(name=name, value=value, group="wasinn.backends")
               for name, value in entries.items()]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group=None: importlib.metadata.EntryPoints(plugins))


BROKEN = {
    "missing": ("wasinn_missing_plugin:Backend",
                "ModuleNotFoundError: No module named 'wasinn_missing_plugin'"),
    "raising": (f"{__name__}:BrokenBackend",
                "RuntimeError: libroute.so: cannot open shared object file"),
}


@pytest.mark.parametrize("plugin", list(BROKEN))
def test_a_plugin_that_cannot_be_imported_is_passed_over_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, plugin: str) -> None:
    # Before: candidates() and choose_name() raised what its import raised, for every
    # encoding that reached it: ggml (which nothing else reads) too.
    entry, error = BROKEN[plugin]
    why = f"backend 'broken' cannot be imported (entry point {entry}): {error}"
    _with_plugins(monkeypatch, broken=entry, routing=f"{__name__}:RoutingBackend")
    registry = BackendRegistry()
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        assert "broken" not in registry.candidates(GGML)
        assert registry.choose_name(GGML, CPU) == "routing"  # "broken" comes first
        _with_plugins(monkeypatch, broken=entry)
        with pytest.raises(UnsupportedOperationError, match=(
                r"^no backend runs ggml on cpu: onnxruntime: does not read ggml; .*; "
                r"broken: backend 'broken' cannot be imported")) as info:
            BackendRegistry().choose_name(GGML, CPU)
    assert info.value.message.endswith(f"broken: {why}")
    warned = [r.getMessage() for r in caplog.records if r.name == "wasinn.backends"]
    assert warned == [f"{why}: it is passed over"] * 2  # once per registry


@pytest.mark.parametrize("plugin", list(BROKEN))
def test_a_plugin_that_cannot_be_imported_is_unsupported_where_it_is_named(
        monkeypatch: pytest.MonkeyPatch, plugin: str) -> None:
    entry, error = BROKEN[plugin]
    _with_plugins(monkeypatch, broken=entry)
    registry = BackendRegistry()
    said = (rf"^backend 'broken' cannot be imported \(entry point {entry}\): "
            rf"{error.replace('(', '[(]').replace(')', '[)]')}$")
    for ask in (lambda: registry.get("broken"), lambda: registry.reads("broken", GGML),
                lambda: registry.has_device("broken", CPU), lambda: registry.get("broken")):
        with pytest.raises(UnsupportedOperationError, match=said):
            ask()


GGML = GraphEncoding.GGML


async def test_an_onnxruntime_older_than_1_25_is_not_used_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # onnxruntime 1.17 to 1.24 divide integers by zero: SIGFPE ended the host process on
    # a model's Div whose divisor a guest set to 0. The extras ask for 1.25 or later.
    require_backend("onnxruntime")
    require_backend("openvino")
    import numpy as np
    import onnxruntime

    import wasinn
    from wasinn.backends.onnxruntime import check_version
    from wasinn.modelgen import affine_onnx

    check_version("1.25.0")
    check_version("1.31.1")
    with pytest.raises(UnsupportedOperationError) as caught:
        check_version("1.24.4")
    assert caught.value.message == (
        "onnxruntime 1.24.4 is older than 1.25, the first that checks an integer division's "
        "divisor for zero (older ones end the host process with SIGFPE on a division by "
        "zero): expected onnxruntime>=1.25 (pip install -U 'wasinn[onnxruntime]')")
    monkeypatch.setattr(onnxruntime, "__version__", "1.24.4")
    async with wasinn.Runtime() as rt:
        with caplog.at_level(logging.WARNING):
            graph = await rt.load([affine_onnx()], "onnx")
        assert graph.backend == "openvino"  # the next that reads ONNX
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        assert out["y"].numpy().tolist() == [[3.0] * 4]
        assert "onnxruntime 1.24.4 is older than 1.25" in caplog.text
        with pytest.raises(UnsupportedOperationError, match=r"older than 1\.25"):
            await rt.load([affine_onnx()], "onnx", backend="onnxruntime")


def test_the_extras_ask_for_an_onnxruntime_that_checks_divisors() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    for extra in ("onnxruntime", "all"):
        assert "onnxruntime>=1.25" in extras[extra], extra


# -- autodetection asks the plugins' sniff -------------------------------------------------
class DoublingGraph(CompiledGraph):
    def __init__(self, device: Device) -> None:
        from wasinn import TensorType
        from wasinn.backends import TensorSpec

        self.device = device
        self.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
        self.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        return {"y": Tensor.from_numpy(inputs["x"].numpy() * 2)}


class SniffingBackend(Backend):
    """Reads its own format (bytes starting ``DOUBLE``), which it recognises by sniff."""

    name = "sniffing"
    encodings = frozenset({GraphEncoding.GGML})

    def __init__(self) -> None:
        self.sniffed: list[bytes] = []

    def devices(self) -> list[Device]:
        return [Device(CPU)]

    def sniff(self, builders: Builders) -> float:
        head = bytes(builders[0][:6])
        self.sniffed.append(head)
        return 0.9 if head == b"DOUBLE" else 0.0

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CompiledGraph:
        assert encoding is GraphEncoding.GGML, encoding
        return DoublingGraph(device)


class LowerSniffingBackend(SniffingBackend):
    """Claims the same bytes, less sure: never chosen beside SniffingBackend."""

    name = "lowersniffing"

    def sniff(self, builders: Builders) -> float:
        return 0.5 if super().sniff(builders) else 0.0

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CompiledGraph:
        raise AssertionError("the lower score was chosen")


async def _doubled(graph: Any) -> list[list[float]]:
    out = await graph.compute({"x": np.ones((1, 4), np.float32)})
    return [list(map(float, row)) for row in out["y"].numpy()]


async def test_autodetect_asks_a_plugins_sniff_where_no_builtin_format_matches(
        tmp_path: Path) -> None:
    # Before: Backend.sniff was never called, and every autodetected load of a plugin's
    # model failed with "match no known format".
    import wasinn

    plugin = SniffingBackend()
    async with wasinn.Runtime(backends=[LowerSniffingBackend(), plugin]) as rt:
        graph = await rt.load([b"DOUBLE model"])  # encoding autodetect, no backend named
        assert graph.backend == "sniffing"
        assert await _doubled(graph) == [[2.0] * 4]
        named = await rt.load([b"DOUBLE model"], backend="sniffing")
        assert named.backend == "sniffing"
    assert plugin.sniffed == [b"DOUBLE", b"DOUBLE"]
    # A config model with the default encoding (autodetect).
    (tmp_path / "double.bin").write_bytes(b"DOUBLE model")
    config = tmp_path / "wasinn.toml"
    config.write_text('[models.doubler]\nfiles = ["double.bin"]\n')
    async with wasinn.Runtime.from_config(config, backends=[SniffingBackend()]) as rt:
        graph = await rt.load_by_name("doubler")
        assert graph.backend == "sniffing"
        assert await _doubled(graph) == [[2.0] * 4]


async def test_a_builtin_format_is_detected_without_asking_the_plugins() -> None:
    require_backend("onnxruntime")
    import wasinn
    from wasinn.modelgen import affine_onnx

    plugin = SniffingBackend()
    async with wasinn.Runtime(backends=[plugin]) as rt:
        graph = await rt.load([affine_onnx()])
        assert graph.backend == "onnxruntime"
    assert plugin.sniffed == []


async def test_an_entry_point_plugin_is_asked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import wasinn

    _with_plugins(monkeypatch, sniffing=f"{__name__}:SniffingBackend")
    async with wasinn.Runtime() as rt:
        graph = await rt.load([b"DOUBLE model"])
        assert graph.backend == "sniffing"
        assert await _doubled(graph) == [[2.0] * 4]


async def test_bytes_nobody_claims_name_the_plugins_asked() -> None:
    import wasinn
    from wasinn import InvalidEncodingError

    builtin = (r"^autodetect: 7 bytes starting 4e4f5448494e47 match no known format: "
               r"expected ONNX .*TensorFlow GraphDef/SavedModel")
    async with wasinn.Runtime(backends=[SniffingBackend(), RoutingBackend()]) as rt:
        with pytest.raises(InvalidEncodingError, match=(
                builtin + r"; nor does a plugin backend's sniff claim them \(asked: "
                r"sniffing\); routing read\(s\) several encodings, which its sniff cannot "
                r"tell apart: declare the model's encoding$")):
            await rt.load([b"NOTHING"])
        with pytest.raises(InvalidEncodingError, match=(
                builtin + r"; nor does a plugin backend's sniff claim them \(asked: "
                r"sniffing\)$")):
            await rt.load([b"NOTHING"], backend="sniffing")
    async with wasinn.Runtime() as rt:  # no plugin to ask: the built-in detection's error
        with pytest.raises(InvalidEncodingError, match=builtin + "$"):
            await rt.load([b"NOTHING"])


def test_a_sniff_that_raises_is_passed_over_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    class Raising(SniffingBackend):
        name = "raising"

        def sniff(self, builders: Builders) -> float:
            raise ValueError("cannot read that")

    registry = BackendRegistry(extra=[Raising(), SniffingBackend()], discover_plugins=False)
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        found = registry.sniff([b"DOUBLE"], CPU)
    assert (found.name, found.encoding, found.asked) == ("sniffing", GGML,
                                                         ["raising", "sniffing"])
    assert ("backend 'raising''s sniff raised ValueError: cannot read that: it is passed "
            "over") in caplog.text
    assert registry.sniff([b"DOUBLE"], GPU).asked == []  # no gpu device: not asked


def test_the_default_sniff_says_0_for_bytes_of_no_known_format() -> None:
    # Before: it raised the built-in detection's InvalidEncodingError.
    assert Backend.sniff(RoutingBackend(), [b"NOTHING"]) == 0.0
    assert Backend.sniff(RoutingBackend(), [b"GGUF\x03\x00\x00\x00"]) == 1.0
