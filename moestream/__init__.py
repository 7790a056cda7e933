"""moestream: run Mixture-of-Experts models whose experts do not fit in memory.

model, tokenizer = moestream.load("out/", memory_budget="8G")
mlx_lm.generate(model, tokenizer, "Hello")
moestream.stats(model).hit_rate
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load", "runtime_of", "stats", "verify"]


def __getattr__(name: str) -> Any:
    # The runtime is imported on first use, so the converter never loads it.
    if name in ("load", "runtime_of", "stats"):
        return getattr(import_module(".runtime", __name__), name)
    if name == "verify":
        return import_module(".formats.verify", __name__).verify
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
