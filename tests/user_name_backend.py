"""A fake backend whose load asks for the user's name, as torch 2.11's
``torch.export.load`` does (its ``import torch._dynamo`` calls :func:`getpass.getuser`
for torch's cache folder), for the sandbox's test that a confined process, which may not
read the passwd database, is told the name.

Its recipes are :class:`~tests.fake_backend.FakeBackend`'s with the expected name last:
``b"fake:add=1:user=NAME"``. The load fails with what getpass raises where it cannot
name the user, and with InvalidEncodingError where it names another.
"""

from __future__ import annotations

import getpass

from tests.fake_backend import FakeBackend, FakeGraph
from wasinn.backends.base import Builders, Device, LoadOptions
from wasinn.enums import GraphEncoding
from wasinn.errors import InvalidEncodingError


class UserNameBackend(FakeBackend):
    name = "user-name"

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> FakeGraph:
        graph = super().load(builders, encoding, device, options)
        expected = bytes(builders[0]).decode().rpartition(":user=")[2]
        name = getpass.getuser()
        if name != expected:
            raise InvalidEncodingError(f"user-name: the user is {name!r}, not {expected!r}")
        return graph
