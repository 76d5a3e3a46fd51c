"""Guests in WebAssembly text format: ``is_component`` tells a component from a core module
whatever comments come first, so ``run_wasm`` hands a ``.wat`` component to the component
runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import wasmtime
import wasmtime.component

import wasinn
from wasinn.host.engine import compile_component, is_component
from wasinn.host.runner import run_wasm

TESTS = Path(__file__).parent

#: A WASI 0.2 command component whose ``run`` returns ok (``@OK@`` = 0) or err (1).
RUN_COMPONENT = """\
;; A command component in text format: comments come before `(component`.
(; a block comment (; with a nested one ;) and (component in it ;)
(component
  (core module $m
    (func (export "run") (result i32) (i32.const @OK@)))
  (core instance $i (instantiate $m))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $run-instance (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $run-instance)))
"""


def component_texts() -> list[Path]:
    # Every hand-written component starts with `;;` comments.
    return sorted((TESTS / "components").glob("*.wat"))


@pytest.mark.parametrize("path", component_texts(), ids=lambda p: p.name)
def test_hand_written_components_are_recognised(path: Path) -> None:
    text = path.read_bytes()
    assert text.startswith(b";;")
    assert is_component(text)


@pytest.mark.parametrize("path", [TESTS / "components" / "chain" / "chain.wat",
                                  *sorted((TESTS / "wat").glob("*.wat"))],
                         ids=lambda p: p.name)
def test_core_modules_in_text_are_not_components(path: Path) -> None:
    assert not is_component(path.read_bytes())


@pytest.mark.parametrize(("text", "component"), [
    (b"(component)", True),
    (b"  \n(module)", False),
    (b";; a line comment\n(component)", True),
    (b";; (module) in a line comment\n(component)", True),
    (b"(; block ;)(component)", True),
    (b"(; outer (; inner ;) (module) ;)\n;; x\n(component)", True),
    (b"(; (component) ;) (module)", False),
    (b"(func)", False),  # a core module's fields without `(module`
    # text that does not convert: judged by its first keyword after the comments, so the
    # compiler meant for it reports the error
    (b";; broken\n(; ;)\n(component (bogus))", True),
    (b";; broken\n(module (bogus))", False),
    (b"(; unterminated (component)", False),
    (b"\xff\xfe not text", False),
])
def test_is_component_skips_comments(text: bytes, component: bool) -> None:
    assert is_component(text) is component


def test_binary_formats_are_told_apart_by_their_layer() -> None:
    assert is_component(bytes(wasmtime.wat2wasm(";; c\n(component)")))
    assert not is_component(bytes(wasmtime.wat2wasm(";; c\n(module)")))


def test_the_engine_compiles_a_commented_component_text(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path))
    text = (TESTS / "components" / "echo_bytes.wat").read_bytes()
    assert is_component(text)
    component = compile_component(text)
    assert isinstance(component, wasmtime.component.Component)


@pytest.mark.parametrize(("ok", "code"), [(0, 0), (1, 1)])
async def test_run_wasm_runs_a_component_text_that_starts_with_comments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ok: int, code: int) -> None:
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "command.wat"
    path.write_text(RUN_COMPONENT.replace("@OK@", str(ok)))
    async with wasinn.Runtime() as rt:
        # 0 when run returns ok, 1 when it returns an error: the component ran
        assert await run_wasm(rt, path) == code


async def test_run_wasm_reaches_the_component_runner_for_a_shim_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "echo_bytes.wat"
    path.write_bytes((TESTS / "components" / "echo_bytes.wat").read_bytes())
    async with wasinn.Runtime() as rt:
        # before the fix: "is not a valid WebAssembly module ... expected a WebAssembly
        # module but was given a WebAssembly component"; now the component linker says
        # what this test shim needs that a plain run does not give it
        with pytest.raises(wasinn.InvalidArgumentError,
                           match=r"cannot instantiate echo_bytes\.wat: component imports "
                                 r"instance `host`"):
            await run_wasm(rt, path)


#: A command component whose start function calls ``wasi:cli/exit`` with err: its
#: ``run`` (which would return ok) never runs.
START_EXIT_COMPONENT = """\
;; exits while starting
(component
  (import "wasi:cli/exit@0.2.0" (instance $exit
    (export "exit" (func (param "status" (result))))))
  (core func $exit (canon lower (func $exit "exit")))
  (core module $m
    (import "cli" "exit" (func $exit (param i32)))
    (func $starting (call $exit (i32.const 1)))
    (start $starting)
    (func (export "run") (result i32) (i32.const 0)))
  (core instance $i (instantiate $m (with "cli" (instance (export "exit" (func $exit))))))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $run-instance (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $run-instance)))
"""


async def test_an_exit_from_a_start_function_is_the_exit_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: InvalidArgumentError "cannot instantiate", as if the component did not link.
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "start_exit.wat"
    path.write_text(START_EXIT_COMPONENT)
    async with wasinn.Runtime() as rt:
        assert await run_wasm(rt, path) == 1
