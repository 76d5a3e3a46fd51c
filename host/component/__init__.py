"""Component guests of ``wasi:nn@0.2.0-rc-2024-10-28`` (and the earlier release candidates).

:func:`run_component` runs a WASI 0.2 command component (``wasinn run`` and
``Runtime.run_wasm`` reach it for components); :class:`ComponentGuest` instantiates a
component and calls any of its exports (tests, embedding). Importing this package
installs the fast ``list<u8>`` conversion (:mod:`wasinn.host.component.fastlist`).
"""

from wasinn.host.component import fastlist
from wasinn.host.component.guest import ComponentGuest, compile_guest, run_component
from wasinn.host.component.linking import EXT_PACKAGE, NN_VERSIONS
from wasinn.host.component.service import NNService

fastlist.install()

__all__ = [
    "EXT_PACKAGE",
    "NN_VERSIONS",
    "ComponentGuest",
    "NNService",
    "compile_guest",
    "run_component",
]
