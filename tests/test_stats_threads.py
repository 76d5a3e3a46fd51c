"""Stats read from a thread that is not trio's (a metrics scrape's) while trio changes
what they count: a read never fails."""

from __future__ import annotations

import sys
import threading

from wasinn.actors.batching import Batcher
from wasinn.actors.queue import Request
from wasinn.actors.stats import RequestStats


def test_queued_batches_reads_while_trio_adds_and_removes_batches() -> None:
    # One thread plays trio's batch tasks (a batch's queue entry added, then discarded
    # once granted, as Batcher._lead does); this one reads as DeviceActor.stats does.
    batcher = Batcher("cpu", None, None, None, None, None,  # type: ignore[arg-type]
                      RequestStats())
    waiting = [Request() for _ in range(32)]
    churning = [Request() for _ in range(32)]
    for request in [*waiting, *churning]:
        request.queued = True
    batcher._requests.update(waiting)
    stop = threading.Event()

    def trio_side() -> None:
        i = 0
        while not stop.is_set():
            request = churning[i % 32]
            batcher._requests.add(request)
            batcher._requests.discard(request)
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    thread = threading.Thread(target=trio_side)
    thread.start()
    try:
        counts = {batcher.queued_batches for _ in range(100_000)}
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert counts <= {32, 33}
