"""``load-by-name`` for a guest: what it is told when a registered model fails to load.

The registry's load errors are written for the host's operator: they name the config
file, the registry key and the model's files on the host. A guest chose only a name, so
it gets the error's code and a message that names that model and nothing of the host's
file system; the full message goes to the host's log. A name that is not registered is
the guest's own mistake and keeps its message (it lists the registered names).
"""

from __future__ import annotations

import logging
from typing import Any

from wasinn.errors import ClosedResourceError, NotFoundError, WasiNNError
from wasinn.host.abi import ModelNotFoundError
from wasinn.host.scheduler_api import Portal, RuntimeLike

log = logging.getLogger("wasinn.host.nn")


def load_registered(portal: Portal, runtime: RuntimeLike, name: str) -> Any:
    """``runtime.load_by_name(name)`` from a guest's thread.

    Raises the registry's error as is for a name that is not registered (and
    ClosedResourceError when the runtime is closing); a registered model's load error is
    logged and raised again with the same code, its message replaced by one that names
    the model only (ModelNotFoundError for a file that is missing).
    """
    try:
        return portal.run(runtime.load_by_name, name)
    except ClosedResourceError:
        raise
    except WasiNNError as exc:
        if name not in portal.run_sync(runtime.model_names):
            raise
        log.warning("load-by-name %r: %s", name, exc.message)
        told = (f"registered model {name!r} could not be loaded ({exc.code.value}): the "
                "host's log says why")
        if isinstance(exc, NotFoundError):  # its file is missing: WasmEdge's errno 103
            raise ModelNotFoundError(told) from exc
        raise exc.retold(told) from exc
