"""A full queue on a ``fair`` device: no tenant can lock the others out by filling it.

A request that finds the queue full takes the place of the request that the tenant with
the most requests waiting would have served last, where that tenant has more waiting than
the newcomer's tenant plus one; the request pushed out raises TooLargeError saying so.
A priority device refuses the newcomer, as before.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import trio
import trio.testing

from tests.support import gate_job
from wasinn import TooLargeError
from wasinn.actors import DeviceActor, FairSharePolicy, PriorityDeadlinePolicy, Request
from wasinn.actors.queue import QueuePolicy
from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget


async def submit(actor: DeviceActor, name: str, tenant: str, outcomes: dict[str, Any],
                 ran: list[str], priority: int = 0) -> None:
    def job() -> None:
        ran.append(name)

    try:
        await actor.execute(job, tenant=tenant, priority=priority)
        outcomes[name] = "ran"
    except TooLargeError as exc:
        outcomes[name] = exc


async def full_queue(policy: QueuePolicy, arrivals: list[tuple[str, str]], *,
                     queue_limit: int = 4) -> tuple[dict[str, Any], list[str], int]:
    """A one-worker device with ``policy`` and ``queue_limit``, its slot held by a gated
    job; ``arrivals`` (request name, tenant) queued one after another. Returns each
    request's outcome ("ran" or its TooLargeError), the order they ran in, and how many
    requests the device counted as rejected."""
    actor = DeviceActor(Device(ExecutionTarget.CPU), workers=1, queue_limit=queue_limit,
                        policy=policy)
    outcomes: dict[str, Any] = {}
    ran: list[str] = []
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        async with trio.open_nursery() as requests:
            requests.start_soon(functools.partial(actor.execute, gate_job(gate)))
            await trio.testing.wait_all_tasks_blocked()
            for name, tenant in arrivals:
                requests.start_soon(submit, actor, name, tenant, outcomes, ran)
                await trio.testing.wait_all_tasks_blocked()
            assert actor.queued <= queue_limit
            gate.set()
        rejected = actor.stats().rejected
        nursery.cancel_scope.cancel()
    return outcomes, ran, rejected


FLOOD = [("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("b1", "b"), ("b2", "b"),
         ("b3", "b"), ("a5", "a")]


async def test_a_tenant_that_filled_the_queue_gives_way_to_another_tenant() -> None:
    outcomes, ran, rejected = await full_queue(FairSharePolicy(), FLOOD)
    # b1 takes a4's place (a: 4 waiting, b: 0), b2 takes a3's (a: 3, b: 1); b3 is
    # refused (a: 2, b: 2), and so is a5 (a tenant never pushes out its own requests).
    pushed_out = {name for name, outcome in outcomes.items() if outcome != "ran"}
    assert pushed_out == {"a4", "a3", "b3", "a5"}
    assert sorted(ran) == ["a1", "a2", "b1", "b2"]  # what was kept, and only that
    assert rejected == 4  # (each counted once, as the device's rejected requests)
    message = str(outcomes["a4"])
    assert message.startswith("run on cpu: the request queue is full (4 waiting) and this "
                              "request, of the tenant with the most waiting, gave its "
                              "place to one of tenant 'b': retry later")
    assert "gave its place" not in str(outcomes["b3"])
    assert str(outcomes["b3"]).startswith("run on cpu: the request queue is full (4 waiting): ")


async def test_a_priority_device_refuses_what_comes_to_a_full_queue() -> None:
    outcomes, ran, rejected = await full_queue(PriorityDeadlinePolicy(), FLOOD)
    assert {name for name, outcome in outcomes.items() if outcome != "ran"} == {
        "b1", "b2", "b3", "a5"}
    assert ran == ["a1", "a2", "a3", "a4"]
    assert rejected == 4


def test_the_request_pushed_out_is_the_one_its_tenant_would_have_served_last() -> None:
    policy = FairSharePolicy()
    early, urgent, late = Request(tenant="a"), Request(5, tenant="a"), Request(tenant="a")
    for request in (early, urgent, late):
        policy.push(request)
    assert policy.displace("b") is late  # lowest priority, latest arrival
    assert policy.displace("b") is early  # a: 2 waiting (urgent, early), b: 0
    assert policy.displace("b") is None  # a: 1, b: 0 (the queue is the policy's caller's)
    assert len(policy) == 1 and policy.pop() is urgent


def test_among_equally_long_tenants_the_one_served_most_for_its_weight_gives_way() -> None:
    policy = FairSharePolicy({"c": 4.0})
    for tenant in ("a", "b", "c"):
        for _ in range(3):
            policy.push(Request(tenant=tenant))
    policy.charge("a", 1.0)
    policy.charge("b", 3.0)
    policy.charge("c", 8.0)  # 2 s for its weight: b has had the most
    victim = policy.displace("d")
    assert victim is not None and victim.tenant == "b"


async def test_a_pushed_out_request_leaves_the_queue_and_its_job() -> None:
    # The displaced request's place in the queue is the newcomer's: the device's queue
    # never holds more than queue_limit, and what ran is exactly what was kept.
    outcomes, ran, _ = await full_queue(FairSharePolicy(), [
        ("a1", "a"), ("a2", "a"), ("b1", "b")], queue_limit=2)
    assert outcomes == {"a1": "ran", "b1": "ran", "a2": outcomes["a2"]}
    assert isinstance(outcomes["a2"], TooLargeError)
    assert ran == ["a1", "b1"]
