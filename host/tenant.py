"""Whom a guest's requests are for: its *tenant*.

A pool with ``policy = "fair"`` shares its devices' time equally among the tenants with
requests waiting (:class:`wasinn.actors.FairSharePolicy`). Every compute, run and lease
a guest makes (both ABIs, every context and one-shot graph compute) is made for the
guest's tenant. By default that is the guest's program file name (``classify.wasm``), so
that different guest programs on one host share a fair pool by default while instances of
one program share one tenant's time; ``run_wasm(..., tenant=...)`` names another (``""``
is the tenant of requests that name none, such as the host's own). A compute the guest's
own thread runs on a slot it found free (``try_lease``: nobody waiting) never queues, but
its device time is charged to the tenant all the same.

The models a guest loads from its bytes are named after its tenant too (:func:`graph_name`).
"""

from __future__ import annotations

from wasinn._utf8 import LABEL_REASON, utf8_text
from wasinn.errors import InvalidArgumentError


def guest_tenant(tenant: object, program: str) -> str:
    """The tenant of ``program``'s requests: ``tenant``, or ``program`` when it is None.

    Raises InvalidArgumentError unless ``tenant`` is a str or None, and unless the
    tenant is valid UTF-8 (see :func:`wasinn._utf8.utf8_text`: a program file name
    that is not UTF-8 is refused when no ``tenant`` is given).
    """
    if tenant is None:
        return utf8_text("the program name", program,
                         f"UTF-8 text (it is the guest's tenant when none is given, and "
                         f"{LABEL_REASON})")
    if not isinstance(tenant, str):
        raise InvalidArgumentError(
            f"tenant {tenant!r} ({type(tenant).__name__}): expected a str naming whom the "
            "guest's requests are for (the fair queue policy shares device time among "
            "tenants), or None for the guest's program name")
    return utf8_text("tenant", tenant)


def graph_name(tenant: str, loaded: int) -> str:
    """The name of the model a guest of ``tenant`` loads from its bytes after ``loaded``
    other loads, failed ones included (``classify.wasm#0`` for its first): what its
    figures are reported under (``Runtime.model_stats``, Prometheus' ``model`` label), in
    logs and in errors, as wasi-nn's ``load`` names none; each failed load's error names
    its own. Instances of one program loading their models in the same order report each
    model under one name; ``guest#N`` for the tenant ``""``."""
    return f"{tenant or 'guest'}#{loaded}"
