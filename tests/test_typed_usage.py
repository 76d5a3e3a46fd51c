"""The typed calls of ``tests/typed_usage.py`` run as they type-check: paths of any
``os.PathLike`` kind (``Runtime(path)``, ``Runtime.from_config``, ``load_config``,
``run_wasm``, ``LoadOptions.source``), buffers of any kind (``Tensor.from_bytes``),
numpy integer input keys, ``wasinn.GuestTrap`` and ``wasinn.backends`` after a bare
``import wasinn``. The Makefile's lint checks the same file with mypy --strict.
"""

from __future__ import annotations

from pathlib import Path

from tests import typed_usage
from tests.support import require_backend
from wasinn.modelgen import affine_onnx


def test_every_buffer_kind_makes_the_same_tensor() -> None:
    made = typed_usage.tensors_from_buffers()
    assert [t.numpy().tolist() for t in made] == [[1.0, 2.0, 3.0, 4.0]] * 5


async def test_the_typed_calls_run(tmp_path: Path) -> None:
    # Before: Runtime(os.PathLike) and Runtime(trio.Path) were refused ("expected a
    # RuntimeConfig, a TOML file's path or None ..., not PosixPath"), which
    # Runtime.from_config took; wasinn.GuestTrap did not exist.
    require_backend("onnxruntime")
    said = await typed_usage.typed_calls(tmp_path, affine_onnx())
    doubled = [[3.0] * 4]
    assert said == {
        "load_config(os.PathLike)": ["m"],
        "Runtime(os.PathLike)": doubled,
        "Runtime(trio.Path)": doubled,
        "Runtime.from_config(os.PathLike)": doubled,
        "Runtime.from_config(trio.Path)": doubled,
        "LoadOptions(source=Path)": str(tmp_path / "model.onnx"),
        "compute({np.int64(0): x})": doubled,
        "run_wasm(trio.Path)": 7,
        "run_wasm(os.PathLike)": 7,
        "except wasinn.GuestTrap": "GuestTrap",
    }


def test_the_lint_type_checks_the_typed_calls() -> None:
    makefile = (Path(__file__).parents[1] / "Makefile").read_text(encoding="utf-8")
    lint = makefile.partition("\nlint:")[2].partition("\n\n")[0]
    assert "\t$(BIN)/mypy --strict tests/typed_usage.py" in lint.splitlines()


def test_load_options_keep_a_source_path_as_its_str(tmp_path: Path) -> None:
    # Before: LoadOptions(source=Path) kept the Path (typed str), which a sandboxed
    # graph's process was handed as it was.
    import dataclasses

    import pytest
    import trio

    from wasinn import InvalidArgumentError
    from wasinn.backends import LoadOptions

    model = tmp_path / "m.onnx"
    for given in (model, trio.Path(model), typed_usage.AppPath(model), str(model)):
        options = LoadOptions(source=given)
        assert type(options.source) is str and options.source == str(model), given
        assert dataclasses.replace(options, threads=2).source == str(model)
    assert LoadOptions().source == ""
    for bad in (5, b"/m.onnx", None):
        with pytest.raises(InvalidArgumentError, match=(
                rf"^LoadOptions source={bad!r} \({type(bad).__name__}\): expected a file's "
                r"path, a str or an os\.PathLike of str \(a Path\)$")):
            LoadOptions(source=bad)  # type: ignore[arg-type]
