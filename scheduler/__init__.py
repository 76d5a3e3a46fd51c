"""wasinn.scheduler: the async API (Runtime, Graph, ExecutionContext, Pipeline) and
placement of requests onto device actors."""

from .context import ContextRun, ExecutionContext
from .graph import Graph
from .pipeline import Pipeline
from .runtime import Runtime

__all__ = ["ContextRun", "ExecutionContext", "Graph", "Pipeline", "Runtime"]
