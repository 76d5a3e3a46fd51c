"""wasinn.actors: one actor per device, owning its compiled graphs, queue and threads."""

from .device import DeviceActor
from .lease import Lease
from .queue import (
    FairSharePolicy,
    PriorityDeadlinePolicy,
    QueuePolicy,
    Request,
    TenantRoundRobinPolicy,
)
from .stats import DeviceStats, ModelStats, Outcome, RequestFigures, TenantStats

__all__ = [
    "DeviceActor",
    "DeviceStats",
    "FairSharePolicy",
    "Lease",
    "ModelStats",
    "Outcome",
    "PriorityDeadlinePolicy",
    "QueuePolicy",
    "Request",
    "RequestFigures",
    "TenantRoundRobinPolicy",
    "TenantStats",
]
