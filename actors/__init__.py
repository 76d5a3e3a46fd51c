"""wasinn.actors: one actor per device, owning its compiled graphs, queue and threads."""

from .device import DeviceActor
from .queue import PriorityDeadlinePolicy, QueuePolicy, Request, TenantRoundRobinPolicy

__all__ = [
    "DeviceActor",
    "PriorityDeadlinePolicy",
    "QueuePolicy",
    "Request",
    "TenantRoundRobinPolicy",
]
