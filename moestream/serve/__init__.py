"""moestream serve: mlx_lm.server's OpenAI API in front of a streaming model.

mlx_lm.server does the work: its APIHandler (HTTP, SSE, tools, logprobs),
ResponseGenerator and BatchGenerator (continuous batching), LRUPromptCache.
What is ours: moestream's load behind its ModelProvider, a memory plan that
counts the sequences decoded at once and the prompt cache, a context bound per
request, /v1/models for the one served model, /metrics, a request body bound,
and a bad expert record failing only the requests that need it.

    app       the handler, the response generator, the Server
    provider  the ModelProvider and the server's memory plan
    metrics   counters and /metrics
    faults    the records that failed their read, for /health and /metrics
    page      the page at / (static/), /stats and /stats/stream
    live      the snapshots of the runtime's stats the page draws
"""

from .app import LOG_FORMAT, Server
from .metrics import ServerMetrics, render_metrics
from .provider import RequestError, ServePlan, ServerOptions, plan_server

__all__ = [
    "LOG_FORMAT",
    "RequestError",
    "ServePlan",
    "Server",
    "ServerMetrics",
    "ServerOptions",
    "plan_server",
    "render_metrics",
]
