"""The public surface of `wasinn`: declared once in __init__, every name resolvable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import wasinn
import wasinn.actors
import wasinn.backends
import wasinn.errors
import wasinn.scheduler

PUBLIC = {
    # core types
    "Tensor", "TensorType", "GraphEncoding", "ExecutionTarget", "host_copies", "__version__",
    # the async API
    "Runtime", "Graph", "ExecutionContext", "Pipeline", "RuntimeConfig", "Batching",
    # the error tree
    "WasiNNError", "ErrorCode", "InvalidArgumentError", "InvalidEncodingError", "TimeoutError_",
    "BackendRuntimeError", "BatchingError", "UnsupportedOperationError", "TooLargeError",
    "NotFoundError", "ClosedResourceError", "SecurityError", "UnknownError", "ConfigError",
    "UnknownNameError", "DeviceLostError", "QueueFullError",
    # what a guest that traps raises (no WasiNNError: see wasinn.errors)
    "GuestTrap",
}


def test_all_is_the_declared_surface() -> None:
    assert set(wasinn.__all__) == PUBLIC
    assert len(wasinn.__all__) == len(set(wasinn.__all__))


def test_every_public_name_resolves() -> None:
    for name in wasinn.__all__:
        assert getattr(wasinn, name) is not None, name
    assert set(wasinn.__all__) <= set(dir(wasinn))


def test_public_classes_claim_wasinn_as_home() -> None:
    for name in ("Runtime", "Graph", "ExecutionContext", "Pipeline", "Tensor"):
        assert getattr(wasinn, name).__module__.startswith("wasinn."), name


def test_errors_are_one_tree() -> None:
    # All but a guest's trap, which is the guest's failure, not the API's (wasinn.errors
    # says so).
    for name in wasinn.__all__:
        obj = getattr(wasinn, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, wasinn.WasiNNError) == (name != "GuestTrap"), name


def test_guest_trap_is_exported_and_what_wasinn_errors_says_is_no_wasinn_error() -> None:
    # Before: the docstring said "Every error wasinn raises is a WasiNNError", and a
    # guest's trap (run_timeout, fuel) was reachable as wasinn.host.runner.GuestTrap only.
    from wasinn.host.runner import GuestTrap

    assert wasinn.GuestTrap is GuestTrap and not issubclass(GuestTrap, wasinn.WasiNNError)
    doc = " ".join((wasinn.errors.__doc__ or "").split())
    assert "Every error wasinn raises is a :class:`WasiNNError`" not in doc
    for said in ("wasinn.GuestTrap", "RuntimeError", "not a WasiNNError"):
        assert said in doc, said


def test_subpackages_are_reached_from_a_bare_import() -> None:
    # In a fresh interpreter: this file imports them at its top. Before: AttributeError,
    # "module 'wasinn' has no attribute 'backends'", though mypy accepted the spelling
    # (the README's options=wasinn.backends.LoadOptions(source=path)).
    code = (
        "import sys, wasinn\n"
        "assert wasinn.backends.LoadOptions(source='m.onnx').source == 'm.onnx'\n"
        "assert wasinn.scheduler.ContextRun.__name__ == 'ContextRun'\n"
        "assert wasinn.actors.DeviceStats.__name__ == 'DeviceStats'\n"
        "for name in ('configs', 'enums', 'errors', 'host', 'modelgen', 'tensor'):\n"
        "    assert getattr(wasinn, name).__name__ == 'wasinn.' + name, name\n"
        "    assert name in dir(wasinn), name\n"
        "print(sorted(m for m in ('onnxruntime', 'openvino', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]  # still no backend library imported


def test_a_bare_import_of_wasinn_imports_no_backend_or_guest_library() -> None:
    code = ("import sys, wasinn\n"
            "print(sorted(m for m in ('onnxruntime', 'openvino', 'torch', 'wasmtime')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["[]"]


def test_backends_surface() -> None:
    for name in wasinn.backends.__all__:
        assert hasattr(wasinn.backends, name), name
    assert {"Backend", "CompiledGraph", "BackendRegistry", "Device", "TensorSpec"} <= set(
        wasinn.backends.__all__)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        wasinn.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_types_documented_calls_return_or_raise_are_exported() -> None:
    # A full queue (retry later) is told apart from a tensor too large (don't).
    assert wasinn.QueueFullError is wasinn.errors.QueueFullError
    assert issubclass(wasinn.QueueFullError, wasinn.TooLargeError)
    assert wasinn.QueueFullError.__module__ == "wasinn.errors"
    # What g.lease() / ctx.lease() return, to annotate a helper that runs one.
    assert "Lease" in wasinn.actors.__all__ and wasinn.actors.Lease.__name__ == "Lease"
    assert "ContextRun" in wasinn.scheduler.__all__
    assert wasinn.scheduler.ContextRun.__name__ == "ContextRun"
    for module in (wasinn.actors, wasinn.scheduler):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_every_error_the_readme_puts_in_the_tree_is_in_wasinn_errors() -> None:
    # Before: `except wasinn.errors.ConfigError:`, as the README reads, raised
    # AttributeError (it was wasinn.ConfigError only).
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    tree = readme.partition("Errors form one tree (`wasinn.errors`):")[2]
    tree = tree.partition("each message says")[0]
    named = set(re.findall(r"`([A-Z]\w*Error_?)`", tree))
    assert {"WasiNNError", "ConfigError", "ClosedResourceError", "TimeoutError_"} <= named
    for name in sorted(named):
        error = getattr(wasinn.errors, name)  # (AttributeError: not there)
        assert issubclass(error, wasinn.errors.WasiNNError), name
        assert error is getattr(wasinn, name), name
    from wasinn.errors import ConfigError

    assert issubclass(ConfigError, wasinn.errors.InvalidArgumentError)
    with pytest.raises(AttributeError, match=r"module 'wasinn\.errors' has no attribute 'Nope'"):
        wasinn.errors.Nope  # type: ignore[attr-defined]  # noqa: B018


def test_the_lazy_getattr_is_hidden_from_type_checkers() -> None:
    # A module __getattr__ a type checker can see types every misspelt wasinn.X as Any:
    # it must sit under `if not TYPE_CHECKING:`, and every lazy name be imported under
    # `if TYPE_CHECKING:` instead.
    source = Path(wasinn.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source)
    top_level_defs = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert not top_level_defs & {"__getattr__", "__dir__"}
    hidden: set[str] = set()
    typed: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        test = ast.unparse(node.test)
        if test == "not TYPE_CHECKING":
            hidden |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif test == "TYPE_CHECKING":
            typed |= {alias.asname or alias.name for n in node.body
                      if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert {"__getattr__", "__dir__"} <= hidden
    assert set(wasinn._LAZY) <= typed
    # The subpackages not imported with wasinn itself, reached lazily at run time.
    assert {"actors", "backends", "host", "modelgen", "scheduler"} <= typed


@pytest.mark.slow
def test_mypy_refuses_a_misspelt_public_name(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    typo = tmp_path / "typo.py"
    typo.write_text("import wasinn\n\ntry:\n    pass\nexcept wasinn.TimeoutError:\n    pass\n")
    good = tmp_path / "good.py"
    good.write_text(
        "import wasinn\nimport wasinn.actors\nimport wasinn.scheduler\n\n"
        "try:\n    pass\nexcept (wasinn.TimeoutError_, wasinn.QueueFullError):\n    pass\n"
        "config: wasinn.RuntimeConfig | None = None\n"
        "lease: wasinn.actors.Lease[dict[str, wasinn.Tensor]] | None = None\n"
        "run: wasinn.scheduler.ContextRun | None = None\n")
    # One run for both files (most of its time goes to the packages wasinn imports).
    stdout, stderr, status = api.run([
        "--strict", "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
        str(typo), str(good)])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 1, (stdout, stderr)
    assert len(errors) == 1, stdout
    assert errors[0].startswith(f"{typo}:5: error: Module has no attribute \"TimeoutError\"")
    assert errors[0].endswith("[attr-defined]")
