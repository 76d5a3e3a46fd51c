"""Guest limits come from the runtime's config when it has a ``[guests]`` table."""

from __future__ import annotations

from types import SimpleNamespace

from wasinn.host.limits import GuestLimits, limits_of


def test_defaults_without_a_guests_table() -> None:
    assert limits_of(SimpleNamespace(config=SimpleNamespace())) == GuestLimits()
    assert limits_of(object()) == GuestLimits()


def test_guests_table_overrides_the_fields_it_sets() -> None:
    runtime = SimpleNamespace(config=SimpleNamespace(
        guests=SimpleNamespace(max_graphs=2, max_tensor_bytes=1024, max_contexts=None)))
    assert limits_of(runtime) == GuestLimits(max_graphs=2, max_tensor_bytes=1024)
