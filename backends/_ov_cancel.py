"""Cancelling a running OpenVINO infer request (for :mod:`wasinn.backends.openvino`).

A run under a cancellation hooks its request's ``cancel`` to it (:func:`_infer`), and a
cancel that may have come before OpenVINO marked the request busy is repeated until the
run returns (:class:`_Canceller`). A request that may have been cancelled is not pooled
again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .base import Cancellation


def _infer(request: Any, cancellation: Cancellation | None) -> bool:
    """Run ``request`` to its end, or until ``cancellation`` (hooked to a
    :class:`_Canceller` of the request). Returns whether the request may be pooled again:
    not if it was cancelled (a cancel() may still be running on it)."""
    if cancellation is None:
        request.infer()
        return True
    canceller = _Canceller(request)
    forget = cancellation.on_cancel(canceller)
    try:
        if cancellation.cancelled:  # before the hook was set: it ran at once, for nothing
            raise RuntimeError("cancelled as the run was about to begin")
        request.infer()
    finally:
        canceller.over = True
        forget()
    return not cancellation.cancelled


class _Canceller:
    """Cancels one run's infer request, and goes on cancelling it until the run is over.

    OpenVINO ignores cancel() on a request that is not running yet: a cancel that came
    after the run's last look at its cancellation (:func:`_infer`) but before OpenVINO
    marked the request busy would be lost, and the run would go to its end. Looking again
    after starting needs ``start_async``, which hands every run to OpenVINO's executor
    thread: measured +100-150 us a run through a worker thread on a 2-vCPU VM
    (MobileNetV2: +3.6-5.6 % became +8.7-11 %). Instead, a cancelled run that is not over
    yet gets a thread that cancels the request again, 0.5 ms later and then at growing
    intervals (up to 50 ms), until the run returns: the first repeat after the request
    turned busy stops it. Costs nothing on runs that are not cancelled."""

    __slots__ = ("over", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        #: Set by the running thread once ``infer()`` has returned (or raised).
        self.over = False

    def __call__(self) -> None:
        self.request.cancel()
        if not self.over:
            threading.Thread(target=self._repeat, name="wasinn openvino cancel",
                             daemon=True).start()

    def _repeat(self) -> None:
        delay = _CANCEL_REPEAT_S
        while not self.over:
            time.sleep(delay)
            if self.over:
                return
            try:
                self.request.cancel()
            except Exception:  # nothing left to cancel
                return
            delay = min(delay * 2, _CANCEL_REPEAT_MAX_S)


#: How soon a cancelled run's request is cancelled again, and the longest interval.
_CANCEL_REPEAT_S, _CANCEL_REPEAT_MAX_S = 0.0005, 0.05
