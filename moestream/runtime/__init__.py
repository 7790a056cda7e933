"""run-moe: generate with a converted model, streaming experts from disk."""

from .config import RuntimeConfig
from .loader import (
    BudgetError,
    MemoryPlan,
    Runtime,
    load,
    parse_size,
    runtime_of,
    stats,
)
from .stats import RuntimeStats
from .store import ExpertReadError

__all__ = [
    "BudgetError",
    "ExpertReadError",
    "MemoryPlan",
    "Runtime",
    "RuntimeConfig",
    "RuntimeStats",
    "load",
    "parse_size",
    "runtime_of",
    "stats",
]
