"""run-moe: generate with a converted model, streaming experts from disk."""

from ..units import parse_size
from .backend import ExecutionPlan
from .config import RuntimeConfig, Tuning, config_from
from .loader import Runtime, load, runtime_of, stats
from .memory import BudgetError, MemoryPlan
from .stats import RuntimeStats
from .store import ExpertReadError

__all__ = [
    "BudgetError",
    "ExecutionPlan",
    "ExpertReadError",
    "MemoryPlan",
    "Runtime",
    "RuntimeConfig",
    "RuntimeStats",
    "Tuning",
    "config_from",
    "load",
    "parse_size",
    "runtime_of",
    "stats",
]
