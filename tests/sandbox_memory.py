"""What a sandbox process holds before it loads a model, as that process measures it, for
the tests whose memory bounds must leave room for it: it depends on the machine and the
installed builds (numpy's OpenBLAS keeps about 40 MB of buffers per core: 0.1 GB on 2
cores, 0.7 GB on 16), so a bound written into a test holds on one machine only."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from wasinn import GraphEncoding, InvalidArgumentError
from wasinn.backends import Backend, BackendRef, Device, LoadOptions
from wasinn.backends.sandbox import MIN_MAX_BYTES, Spares, load_sandboxed


def held_before_load(backend: Backend | BackendRef, builders: Sequence[bytes],
                     encoding: GraphEncoding, spares: Spares | None = None) -> int:
    """The memory (``VmData``, what ``max_sandbox_bytes`` bounds) that a sandbox process of
    ``backend`` must be allowed before it loads ``builders`` (its library imported, the
    model's bytes received, the room a load needs), as it says refusing the least bound
    (its process taken from ``spares``, where given)."""
    with pytest.raises(InvalidArgumentError) as refused:
        load_sandboxed(backend, list(builders), encoding, Device.parse("cpu"),
                       LoadOptions(sandbox=True, max_sandbox_bytes=MIN_MAX_BYTES),
                       spares=spares)
    said = re.search(r"expected at least (\d+)", refused.value.message)
    assert said is not None, refused.value.message
    return int(said[1])
