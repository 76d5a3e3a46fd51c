"""Shared test helpers: skipping what this machine lacks, unless WASINN_REQUIRE says it must run.

``WASINN_REQUIRE=gpu,openvino`` turns the skip for those features into a failure, so CI
or a GPU machine can insist that a path really ran.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from wasinn.actors import DeviceActor
from wasinn.backends.base import Device
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError


def required() -> set[str]:
    return {f.strip().lower() for f in os.environ.get("WASINN_REQUIRE", "").split(",") if f.strip()}


def skip_unless(feature: str, available: bool, reason: str) -> None:
    """Skip (or fail, where WASINN_REQUIRE names ``feature``) when ``available`` is false."""
    if available:
        return
    if feature.lower() in required():
        pytest.fail(f"WASINN_REQUIRE={feature} but {reason}")
    pytest.skip(reason)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def has_cuda() -> bool:
    if not has_module("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def require_backend(library: str) -> None:
    skip_unless(library, has_module(library), f"{library} is not installed")


def require_gpu() -> None:
    skip_unless("gpu", has_cuda(), "no CUDA GPU on this machine")


def cpu_pool(**pool: Any) -> RuntimeConfig:
    """A config with one pool: the CPU device, with ``pool``'s settings (workers, ...)."""
    return parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], **pool}}}, None)


async def closed_while_running(actor: DeviceActor, job: Callable[[], object]) -> None:
    """Run ``job`` on ``actor``, expecting the actor to close while it runs: its caller
    is told so at once, not when the job returns (a gated job ignores cancellation)."""
    with pytest.raises(ClosedResourceError, match="closed while the job ran"):
        await actor.execute(job)


@asynccontextmanager
async def serving_actor(**settings: Any) -> AsyncIterator[DeviceActor]:
    """A CPU :class:`DeviceActor` (``settings``: workers, queue_limit...), serving until
    the block ends."""
    async with trio.open_nursery() as nursery:
        yield await nursery.start(DeviceActor(Device(ExecutionTarget.CPU), **settings).serve)
        nursery.cancel_scope.cancel()
