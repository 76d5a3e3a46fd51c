"""Real component guests end to end: the chaining guest (WAT through wasm-tools), the
Python classifier example (componentize-py) run as a WASI 0.2 command, and
``Runtime.run_wasm`` recognising a component."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import wasinn
from tests.component_guests import (
    RecordingRuntime,
    build_chain,
    build_classifier,
    pooling_classifier_onnx,
)
from wasinn.host.component import ComponentGuest, run_component
from wasinn.modelgen import ModelFiles, sample_image


@pytest.fixture(scope="module")
def guest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("component-guests")


@pytest.fixture(scope="module")
def chain_wasm(guest_dir: Path) -> bytes:
    return build_chain(guest_dir)


@pytest.fixture(scope="module")
def classifier_wasm(guest_dir: Path) -> bytes:
    return build_classifier(guest_dir)


X = np.arange(8, dtype=np.float32).reshape(2, 4)


# -- chaining ---------------------------------------------------------------------------
async def test_chaining_passes_the_tensor_resource_without_copying(
        rt: RecordingRuntime, chain_wasm: bytes) -> None:
    async with await ComponentGuest.start(rt, chain_wasm, program="chain") as guest:
        before = wasinn.host_copies()
        out = await guest.call("chain", "affine", "affine3", "x", "x", [2, 4], X.tobytes())
        # only the final output reached host memory (for data()): the intermediate
        # tensor went from the first compute to the second as a host resource
        assert wasinn.host_copies() - before == 1
        np.testing.assert_allclose(np.frombuffer(out, np.float32),
                                   ((X * 2 + 1) * 3 + 0.5).reshape(-1))
        assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0,
                                "error": 0}
        assert len(rt.graphs) == 2 and all(g.unloaded for g in rt.graphs)


async def test_chaining_reports_errors_and_releases_everything(
        rt: RecordingRuntime, chain_wasm: bytes) -> None:
    async with await ComponentGuest.start(rt, chain_wasm, program="chain") as guest:
        message = await guest.call("chain", "affine", "nope", "x", "x", [2, 4], X.tobytes())
        assert isinstance(message, str) and "nope" in message
        message = await guest.call("chain", "affine", "affine3", "x", "wrong", [2, 4],
                                   X.tobytes())
        assert isinstance(message, str) and "wrong" in message
        assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0,
                                "error": 0}
        assert all(g.unloaded for g in rt.graphs)
        # still usable afterwards
        out = await guest.call("chain", "affine", "affine", "x", "x", [2, 4], X.tobytes())
        np.testing.assert_allclose(np.frombuffer(out, np.float32),
                                   ((X * 2 + 1) * 2 + 1).reshape(-1))


# -- the Python classifier example -----------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("classifier-files")
    (directory / "image.bin").write_bytes(sample_image(seed=2).astype("<f4").tobytes())
    (directory / "means.onnx").write_bytes(pooling_classifier_onnx())
    return directory


def _top5(text: str) -> list[int]:
    return [int(line.split("\t")[0]) for line in text.strip().splitlines()]


async def test_classifier_by_name_matches_native(
        rt: RecordingRuntime, classifier_wasm: bytes, files: Path, small_mobilenet: ModelFiles,
        capfd: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    code = await run_component(rt, classifier_wasm, argv=["name:mobilenet", "/data/image.bin"],
                               dirs={"/data": files}, program="classifier.wasm")
    out, err = capfd.readouterr()
    assert code == 0, err
    session = ort.InferenceSession(str(small_mobilenet.onnx), providers=["CPUExecutionProvider"])
    (scores,) = session.run(None, {"input": sample_image(seed=2)})
    assert _top5(out) == [int(i) for i in np.argsort(-scores.reshape(-1))[:5]]
    assert all(g.unloaded for g in rt.graphs)


async def test_classifier_loads_model_bytes_from_a_preopened_dir(
        rt: RecordingRuntime, classifier_wasm: bytes, files: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    code = await run_component(rt, classifier_wasm, argv=["/data/means.onnx", "/data/image.bin"],
                               dirs={"/data": files}, program="classifier.wasm")
    out, err = capfd.readouterr()
    assert code == 0, err
    means = sample_image(seed=2).reshape(3, -1).mean(axis=1)
    assert _top5(out) == [int(i) for i in np.argsort(-means)]


@pytest.mark.parametrize(("argv", "expected"), [
    (["name:nope", "/data/image.bin"], "wasi-nn error NOT_FOUND"),
    (["/data/image.bin", "/data/image.bin"], "wasi-nn error INVALID_ENCODING"),
    (["/data/means.onnx", "/data/image.bin", "tpu"], "wasi-nn error UNSUPPORTED_OPERATION"),
    (["/data/none.onnx", "/data/image.bin"], "No such file"),
    (["too-few"], "usage"),
])
async def test_classifier_failures_exit_1_with_the_error(
        rt: RecordingRuntime, classifier_wasm: bytes, files: Path, argv: list[str],
        expected: str, capfd: pytest.CaptureFixture[str]) -> None:
    code = await run_component(rt, classifier_wasm, argv=argv, dirs={"/data": files},
                               program="classifier.wasm")
    _, err = capfd.readouterr()
    assert code == 1
    assert expected in err


async def test_run_wasm_recognises_a_component(
        rt: RecordingRuntime, classifier_wasm: bytes, files: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "classifier.wasm"
    path.write_bytes(classifier_wasm)
    code = await rt.run_wasm(path, argv=["/data/means.onnx", "/data/image.bin"],
                             dirs={"/data": files})
    out, err = capfd.readouterr()
    assert code == 0, err
    assert len(_top5(out)) == 3


async def test_run_component_rejects_a_component_without_run(rt: RecordingRuntime,
                                                             chain_wasm: bytes) -> None:
    with pytest.raises(wasinn.InvalidArgumentError, match="wasi:cli/run"):
        await run_component(rt, chain_wasm)


async def test_run_component_rejects_bytes_that_are_not_a_component(
        rt: RecordingRuntime) -> None:
    with pytest.raises(wasinn.InvalidArgumentError, match="not a valid component"):
        await run_component(rt, b"\0asm\x0d\x00\x01\x00garbage")
