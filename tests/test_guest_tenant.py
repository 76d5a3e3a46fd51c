"""A guest's requests carry its tenant: every compute, run and lease of both ABIs reaches
a ``fair`` pool's queue policy for ``run_wasm(..., tenant=...)``, by default the guest's
program file name. Observed through the policy itself: a FairSharePolicy that records
the tenant of each request queued (``push``) and each run charged (``charge``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import trio

import wasinn
from tests.component_guests import shim_1028
from tests.guest_support import WAT_DIR
from tests.test_component_host import Shim
from tests.test_guest_fuel import affine_run
from wasinn.actors import FairSharePolicy, Request
from wasinn.actors.queue import POLICIES
from wasinn.configs.loader import parse_config
from wasinn.host.component import ComponentGuest
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import run_wasm
from wasinn.modelgen import affine_onnx


class RecordingPolicy(FairSharePolicy):
    """The fair policy, keeping the tenant of each request queued and each run charged."""

    made: ClassVar[list[RecordingPolicy]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: list[str] = []
        self.charged: list[str] = []
        RecordingPolicy.made.append(self)

    def push(self, request: Request) -> None:
        self.pushed.append(request.tenant)
        super().push(request)

    def charge(self, tenant: str, seconds: float) -> None:
        self.charged.append(tenant)
        super().charge(tenant, seconds)


@pytest.fixture
async def fair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> AsyncIterator[tuple[wasinn.Runtime, RecordingPolicy]]:
    """A runtime whose one CPU device (one worker) has a recording fair policy, and the
    model "affine" (y = 2x + 1 over f32[n, 4]) that the guests run."""
    monkeypatch.setattr(RecordingPolicy, "made", [])
    monkeypatch.setitem(POLICIES, "fair", RecordingPolicy)
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1,
                          "policy": "fair"}},
        "models": {"affine": {"files": [str(tmp_path / "affine.onnx")], "encoding": "onnx"}},
    }, None)
    async with wasinn.Runtime(config) as rt:
        (policy,) = RecordingPolicy.made
        yield rt, policy


def guest_file(abi: str, work: Path) -> Path:
    """The guest that runs "affine" once through a context: a core module or a component."""
    return WAT_DIR / "affine_compute.wat" if abi == "core" else affine_run(work)


ABIS = ["core", "component"]
#: With a compute_timeout the request runs in trio (compute / run), without one it is
#: leased (and, on a busy device, queued) for the guest's own thread.
TIMEOUT = GuestLimits(compute_timeout=60.0)


@pytest.mark.parametrize("abi", ABIS)
async def test_a_guest_computes_for_its_tenant(
        abi: str, tmp_path: Path, fair: tuple[wasinn.Runtime, RecordingPolicy]) -> None:
    rt, policy = fair
    assert await rt.run_wasm(guest_file(abi, tmp_path), tenant="alice") == 0
    # (the runtime's run_wasm: no compute_timeout, so the guest took the free slot itself,
    # never queued, and was charged all the same)
    assert policy.pushed == []
    assert await run_wasm(rt, guest_file(abi, tmp_path), tenant="alice", limits=TIMEOUT) == 0
    assert policy.charged == ["alice", "alice"]
    # Counted as alice's requests, both the leased run and the one run in trio.
    (alice,) = rt.tenant_stats()
    assert (alice.name, alice.completed, alice.in_caller_thread) == ("alice", 2, 1)


@pytest.mark.parametrize("abi", ABIS)
async def test_a_guest_queues_for_its_tenant_on_a_busy_device(
        abi: str, tmp_path: Path, fair: tuple[wasinn.Runtime, RecordingPolicy]) -> None:
    rt, policy = fair
    guest = guest_file(abi, tmp_path)
    graph = await rt.load_by_name("affine")
    # The device's one slot, held from here: the guest's compute must queue.
    held = await graph.lease({"x": np.ones((1, 4), np.float32)}, tenant="host")
    codes: list[int] = []

    async def run_guest() -> None:
        codes.append(await run_wasm(rt, guest, tenant="alice"))

    with trio.fail_after(60):  # (a hang, not a timing)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_guest)
            while not policy.pushed:
                await trio.sleep(0.01)
            held.cancel()  # the slot goes to the guest's queued request
    assert codes == [0]
    assert policy.pushed == ["alice"]
    assert "alice" in policy.charged  # the run it leased, when it gave the slot back
    await graph.unload()


@pytest.mark.parametrize("abi", ABIS)
async def test_a_guests_tenant_is_its_program_name_by_default(
        abi: str, tmp_path: Path, fair: tuple[wasinn.Runtime, RecordingPolicy]) -> None:
    rt, policy = fair
    guest = guest_file(abi, tmp_path)
    assert await run_wasm(rt, guest, limits=TIMEOUT) == 0
    assert await run_wasm(rt, guest, limits=TIMEOUT, tenant="") == 0  # "" is a tenant too
    assert policy.charged == [guest.name, ""]


async def test_a_component_computes_on_a_graph_for_its_tenant(
        fair: tuple[wasinn.Runtime, RecordingPolicy]) -> None:
    # wasinn:nn/oneshot: a compute without a context, queued on a busy device for the
    # guest's tenant both ways (in trio with a compute_timeout, else leased).
    rt, policy = fair
    for limits, tenant in ((TIMEOUT, "carol"), (GuestLimits(), "dave")):
        guest = await ComponentGuest.start(rt, shim_1028(), program="shim_1028",
                                           limits=limits, tenant=tenant)
        async with guest:
            y = await queued_graph_compute(rt, policy, Shim(guest), tenant)
            np.testing.assert_array_equal(y, [3, 3, 3, 3])
    assert policy.pushed == ["carol", "dave"]
    assert [t for t in policy.charged if t != "host"] == ["carol", "dave"]


async def queued_graph_compute(rt: wasinn.Runtime, policy: RecordingPolicy, shim: Shim,
                               tenant: str) -> np.ndarray[Any, Any]:
    """The shim's graph-compute of "affine" on ones, queued behind a slot held here until
    a request of ``tenant`` waits; its output."""
    x = np.ones((1, 4), np.float32)
    graph = await shim.ok("load-by-name", "affine")
    t = await shim.tensor(x)
    host_graph = await rt.load_by_name("affine")
    held = await host_graph.lease({"x": x}, tenant="host")
    outputs: list[Any] = []

    async def compute() -> None:
        outputs.append(await shim.ok("graph-compute", graph, [("x", t)], None))

    with trio.fail_after(60):  # (a hang, not a timing)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute)
            while tenant not in policy.pushed:
                await trio.sleep(0.01)
            held.cancel()  # the slot goes to the guest's queued request
    await host_graph.unload()
    ((_, y),) = outputs[0]
    return await shim.data(y)


@pytest.mark.parametrize("tenant", [5, b"alice", ["alice"]])
async def test_a_tenant_that_is_no_str_is_refused(
        tenant: Any, tmp_path: Path, fair: tuple[wasinn.Runtime, RecordingPolicy]) -> None:
    rt, policy = fair
    said = (f"tenant {tenant!r} ({type(tenant).__name__}): expected a str naming whom the "
            "guest's requests are for (the fair queue policy shares device time among "
            "tenants), or None for the guest's program name")
    calls = [
        lambda: rt.run_wasm(WAT_DIR / "affine_compute.wat", tenant=tenant),
        lambda: run_wasm(rt, WAT_DIR / "affine_compute.wat", tenant=tenant),
        lambda: ComponentGuest.start(rt, shim_1028(), tenant=tenant),
    ]
    for call in calls:
        with pytest.raises(wasinn.InvalidArgumentError) as caught:
            await call()
        assert caught.value.message == said
    assert policy.pushed == policy.charged == []  # refused before the guest ran
