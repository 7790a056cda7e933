"""convert-moe: a Hugging Face checkpoint -> moestream format v1."""

from .pack import ConvertError, ConvertSummary, convert, quant_predicate
from .source import SourceError

__all__ = [
    "ConvertError",
    "ConvertSummary",
    "SourceError",
    "convert",
    "quant_predicate",
]
