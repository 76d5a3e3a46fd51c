"""The host's environment variables an operator gives confined sandbox processes
(``[runtime] sandbox_env``, :mod:`wasinn.backends._sandbox_env`).

A confined process is given only an allowlist of the host's environment, so that one a
model has compromised cannot hand the host's keys and tokens to a guest; a library that
reads a variable outside it behaved otherwise in the sandbox than outside, with no way to
give it the variable. What is checked here, on real processes (their
``/proc/<pid>/environ``): the variables the setting names, exactly or by a prefix, reach
the graph's process and the spare the next load takes, and a variable it does not name
still does not; a prefix never gives a variable whose name looks like a credential
(``HF_*`` gave ``HF_TOKEN``), which is given only when named exactly, and the host says
which it held back; and a setting that names no variable, the whole environment or
nearly (``A*``), is a config error naming the file and the key.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import wasinn
from tests.support import require_backend, sandbox_children, sandboxed_affine_children
from wasinn import GraphEncoding, Tensor
from wasinn.backends import Device, LoadOptions
from wasinn.backends import _sandbox_process as sandbox_process
from wasinn.backends._sandbox_env import (
    CREDENTIAL_WORDS,
    given,
    held_back,
    looks_like_credential,
)
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import ProcessLimit, Spares, load_sandboxed
from wasinn.configs import ConfigError
from wasinn.configs.loader import load_config, parse_config
from wasinn.modelgen import affine_onnx

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="Linux's /proc/<pid>/environ")

CPU = Device.parse("cpu")
ONES = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
#: What the tests give confined processes: a name, and a prefix.
GIVEN = ["MY_LICENSE_FILE", "HF_*"]


def _host_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's variables: two that :data:`GIVEN` names, four that it does not (a
    secret, a longer name that an exact name is not a prefix of, one that only begins
    like the prefix without its ``_``, and a token that the prefix matches)."""
    monkeypatch.setenv("MY_LICENSE_FILE", "/opt/licenses/site.lic")
    monkeypatch.setenv("HF_HOME", "/srv/hf-cache")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("MY_LICENSE_FILE_BACKUP", "/opt/licenses/old.lic")
    monkeypatch.setenv("HFX_TOKEN", "host-token")
    monkeypatch.setenv("HF_TOKEN", "hf_host-token")


def _environ(pid: int | None) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    assert pid is not None, "no process"
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def _check_given(pid: int | None) -> None:
    environ = _environ(pid)
    assert environ["MY_LICENSE_FILE"] == "/opt/licenses/site.lic"
    assert environ["HF_HOME"] == "/srv/hf-cache"
    for kept_back in ("AWS_SECRET_ACCESS_KEY", "MY_LICENSE_FILE_BACKUP", "HFX_TOKEN",
                      "HF_TOKEN"):
        assert kept_back not in environ, kept_back
    assert environ["PATH"] == os.environ["PATH"]  # (the default allowlist, as it was)


# -- a runtime's sandboxed models ---------------------------------------------------------
async def test_a_runtimes_confined_processes_get_the_variables_its_config_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a confined process was given the allowlist alone, whatever the operator
    # needed its library to see (and [runtime] sandbox_env was an unknown key).
    _host_env(monkeypatch)
    keys = 'sandbox_env = ["MY_LICENSE_FILE", "HF_*"]\n'
    async with sandboxed_affine_children(tmp_path, keys) as children:
        for child in children:
            _check_given(child.pid)


async def test_a_runtime_given_no_setting_keeps_its_confined_processes_to_the_allowlist(
        monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("onnxruntime")
    _host_env(monkeypatch)
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["onnxruntime"]}},
                           "runtime": {"sandbox_spares": 0}}, None)
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([affine_onnx()], "onnx", options={"sandbox": True})
        await graph.compute({"x": np.ones((1, 4), np.float32)})
        (child,) = sandbox_children()
        environ = _environ(child.pid)
        for name in ("MY_LICENSE_FILE", "HF_HOME", "AWS_SECRET_ACCESS_KEY"):
            assert name not in environ, name
        assert environ["PATH"] == os.environ["PATH"]


# -- the backends' pool of processes ------------------------------------------------------
def test_the_spare_a_load_takes_was_started_with_the_pools_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The spare is started before the load that takes it: it has the pool's variables,
    # which the pool knew from its start.
    require_backend("onnxruntime")
    _host_env(monkeypatch)
    backend = BackendRegistry().get("onnxruntime")
    spares = Spares(1, limit=ProcessLimit(4), extra_env=GIVEN)
    graphs = []
    try:
        graphs.append(load_sandboxed(backend, [affine_onnx(2.0, 1.0)], GraphEncoding.ONNX,
                                     CPU, LoadOptions(sandbox=True), spares=spares))
        _check_given(graphs[0].pid)
        deadline = time.monotonic() + 60
        while spares.ready() < 1:
            assert time.monotonic() < deadline, "the spare never imported its library"
            time.sleep(0.02)
        started = {child.pid for child in sandbox_children()}
        graphs.append(load_sandboxed(backend, [affine_onnx(3.0, 0.0)], GraphEncoding.ONNX,
                                     CPU, LoadOptions(sandbox=True), spares=spares))
        assert graphs[1].pid in started - {graphs[0].pid}  # the spare
        _check_given(graphs[1].pid)
        out = graphs[1].run(ONES)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
    finally:
        for graph in graphs:
            graph.close()
        spares.close()
    assert sandbox_children() == []


def test_a_prefix_does_not_replace_what_a_confined_process_is_given_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # XDG_CACHE_HOME is the process's private folder, the one it may write in: a prefix
    # that matches the host's does not give it the host's.
    require_backend("onnxruntime")
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/host-cache")
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/host-data")
    backend = BackendRegistry().get("onnxruntime")
    graph = load_sandboxed(backend, [affine_onnx()], GraphEncoding.ONNX, CPU,
                           LoadOptions(sandbox=True), spares=Spares(0, extra_env=["XDG_*"]))
    try:
        environ = _environ(graph.pid)
        assert environ["XDG_DATA_HOME"] == "/srv/host-data"
        assert environ["XDG_CACHE_HOME"] == environ["HOME"] != "/srv/host-cache"
    finally:
        graph.close()


def test_a_credential_a_prefix_matches_is_given_only_when_named_exactly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: "HF_*", the documented example, gave HF_TOKEN, Hugging Face's access token.
    require_backend("onnxruntime")
    _host_env(monkeypatch)
    monkeypatch.setenv("HF_HUB_API_KEY", "hf_host-key")
    monkeypatch.setattr(sandbox_process, "_told", set())
    backend = BackendRegistry().get("onnxruntime")
    environs = []
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        for extra in (["HF_*"], ["HF_*"], ["HF_TOKEN", "HF_*"]):
            spares = Spares(0, extra_env=extra)
            graph = load_sandboxed(backend, [affine_onnx()], GraphEncoding.ONNX, CPU,
                                   LoadOptions(sandbox=True), spares=spares)
            try:
                environs.append(_environ(graph.pid))
            finally:
                graph.close()
                spares.close()
    for environ in environs:
        assert environ["HF_HOME"] == "/srv/hf-cache"
        assert "HF_HUB_API_KEY" not in environ
    assert "HF_TOKEN" not in environs[0] and "HF_TOKEN" not in environs[1]
    assert environs[2]["HF_TOKEN"] == "hf_host-token"  # (named exactly)
    told = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.getMessage().startswith("a confined sandbox process is not given")]
    line = ("a confined sandbox process is not given HF_HUB_API_KEY, HF_TOKEN, which "
            '"HF_*" of the default list or of [runtime] sandbox_env matches: a prefix never '
            "gives a variable whose name looks like a credential; name it exactly in "
            "sandbox_env to give it")
    # once a process start, at info the first time, then at debug; named exactly,
    # HF_TOKEN is no longer held back
    assert told == [(logging.INFO, line), (logging.DEBUG, line),
                    (logging.DEBUG, line.replace("HF_HUB_API_KEY, HF_TOKEN", "HF_HUB_API_KEY"))]


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID", "OPENAI_API_KEY", "APIKEY", "PGPASSWORD", "DB_PASSWD", "SMTP_PASS",
    "MYSQL_PWD", "GOOGLE_APPLICATION_CREDENTIALS", "SSH_PRIVATE_KEY", "NPM_AUTH",
    "HTTP_AUTHORIZATION", "SESSION_COOKIE", "JWT_SIGNATURE", "hf_token", "My_Secret"])
def test_names_that_look_like_credentials(name: str) -> None:
    prefix = f"{name[:2]}*"  # (it matches the name)
    assert looks_like_credential(name)
    assert not given(name, (prefix,))
    assert held_back(name, (prefix,))
    assert given(name, (name, prefix))  # (named exactly)
    assert not held_back(name, (name, prefix))


def test_the_default_prefixes_hold_back_credential_looking_names_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: with no sandbox_env at all, NVIDIA_API_KEY (NVIDIA's API catalog key) and
    # TORCH_HUB_TOKEN reached every confined process through the default NVIDIA_ and
    # TORCH_ prefixes.
    from wasinn.backends._sandbox_process import _confined_env

    for name, value in [("NVIDIA_API_KEY", "nvapi-secret"), ("TORCH_HUB_TOKEN", "t"),
                        ("NVIDIA_VISIBLE_DEVICES", "0"), ("OMP_NUM_THREADS", "1"),
                        ("CUDA_API_PER_THREAD_DEFAULT_STREAM", "1")]:
        monkeypatch.setenv(name, value)
    env = _confined_env()
    assert "NVIDIA_API_KEY" not in env and "TORCH_HUB_TOKEN" not in env
    assert env["NVIDIA_VISIBLE_DEVICES"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert env["CUDA_API_PER_THREAD_DEFAULT_STREAM"] == "1"
    assert _confined_env(("NVIDIA_API_KEY",))["NVIDIA_API_KEY"] == "nvapi-secret"


def test_what_the_default_prefixes_hold_back_is_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from wasinn.backends import _sandbox_process as sandbox_process

    monkeypatch.setattr(sandbox_process, "_told", set())
    monkeypatch.setenv("NVIDIA_API_KEY", "nvapi-secret")
    with caplog.at_level(logging.INFO, logger="wasinn.backends"):
        sandbox_process._confined_env()
    assert [r.getMessage() for r in caplog.records] == [
        'a confined sandbox process is not given NVIDIA_API_KEY, which "NVIDIA_*" of the '
        "default list or of [runtime] sandbox_env matches: a prefix never gives a variable "
        "whose name looks like a credential; name it exactly in sandbox_env to give it"]


@pytest.mark.parametrize("name", ["HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE",
                                  "MY_LICENSE_FILE", "XDG_DATA_HOME"])
def test_names_that_do_not(name: str) -> None:
    assert not looks_like_credential(name)
    assert given(name, ("HF_*", "MY_LICENSE_*", "XDG_*"))


def test_the_words_are_those_documented() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text().replace("\n  ", " ")
    words = [f"`{word}`" for word in CREDENTIAL_WORDS]
    assert f"{', '.join(words[:-1])} or {words[-1]} in any case" in readme


@pytest.mark.parametrize(("extra_env", "error", "expected"), [
    (["*"], ValueError, r"^extra_env\[0\]: \"\*\" would give a confined sandbox process "
                        r"the host's whole environment"),
    (["HF_HOME", "_*"], ValueError, r"^extra_env\[1\]: '_\*' would give a confined sandbox "
                                    r"process nearly as much of the host's environment as "
                                    r"\"\*\""),
    (["HF_HOME", "A*B"], ValueError, r"^extra_env\[1\]: 'A\*B' is not a variable's name"),
    ("HF_HOME", TypeError, r"^extra_env='HF_HOME': expected a list of names, not a string"),
])
def test_a_pool_refuses_what_names_no_variable(extra_env: object, error: type[Exception],
                                               expected: str) -> None:
    with pytest.raises(error, match=expected):
        Spares(0, extra_env=extra_env)  # type: ignore[arg-type]


# -- the config ---------------------------------------------------------------------------
def test_the_config_takes_names_and_prefixes() -> None:
    assert parse_config({}, None).runtime.sandbox_env == []
    given = ["HF_HOME", "HF_*", "_x1", "WASINN_*", "AB*", "A"]
    config = parse_config({"runtime": {"sandbox_env": given}}, None)
    assert config.runtime.sandbox_env == given


@pytest.mark.parametrize(("value", "expected"), [
    ('["*"]', r"runtime\.sandbox_env\[0\]: \"\*\" would give a confined sandbox process "
              r"the host's whole environment, its keys and tokens included, .*: name the "
              r"variables \(or prefixes such as \"MY_LICENSE_\*\"\), or run a model that "
              r"needs all of it with sandbox = false"),
    ('["HF_HOME", "A*"]', r"runtime\.sandbox_env\[1\]: 'A\*' would give a confined sandbox "
                          r"process nearly as much of the host's environment as \"\*\" \(every "
                          r"variable that begins with 'A'\), which the confinement keeps from "
                          r"a process that a model may have compromised: expected a prefix of "
                          r"at least 2 characters before the \* \(such as \"MY_LICENSE_\*\"\), "
                          r"or the variables' names"),
    ('["_*"]', r"runtime\.sandbox_env\[0\]: '_\*' would give a confined sandbox process "
               r"nearly as much"),
    ('["HF_HOME", "HF*_X"]', r"runtime\.sandbox_env\[1\]: 'HF\*_X' is not a variable's "
                             r"name: expected letters, digits and _ \(not a digit first\), "
                             r"optionally followed by one \*"),
    ('["HF_**"]', r"runtime\.sandbox_env\[0\]: 'HF_\*\*' is not a variable's name"),
    ('["MY-LICENSE"]', r"runtime\.sandbox_env\[0\]: 'MY-LICENSE' is not a variable's name"),
    ('["1ST"]', r"runtime\.sandbox_env\[0\]: '1ST' is not a variable's name"),
    ('[""]', r"runtime\.sandbox_env\[0\]: '' is not a variable's name"),
    ("[1]", r"runtime\.sandbox_env\[0\]: 1 is not a string: expected an environment "
            r"variable's name"),
    ('"HF_HOME"', r"runtime\.sandbox_env: 'HF_HOME': expected a list of the host's "
                  r"environment variables to give confined sandbox processes"),
    ("{ HF_HOME = true }", r"runtime\.sandbox_env: \{'HF_HOME': True\}: expected a list"),
    ('["TMPDIR"]', r"runtime\.sandbox_env\[0\]: a confined sandbox process is always given "
                   r"its own TMPDIR \(its private folder, the one folder it may write in\), "
                   r"never the host's: expected another variable"),
    ('["PYTHONPATH"]', r"runtime\.sandbox_env\[0\]: a confined sandbox process is always "
                       r"given its own PYTHONPATH"),
])
def test_the_config_refuses_what_names_no_variable(tmp_path: Path, value: str,
                                                   expected: str) -> None:
    path = tmp_path / "wasinn.toml"
    path.write_text(f"[runtime]\nsandbox_env = {value}\n")
    with pytest.raises(ConfigError, match=expected) as raised:
        load_config(path)
    assert str(raised.value).startswith(f"{path}: runtime.sandbox_env")
