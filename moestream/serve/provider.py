"""The served model: mlx_lm.server's ModelProvider loading moestream's model,
and the server's memory plan (decode concurrency and prompt cache in the budget)."""

from __future__ import annotations

import argparse
import gc
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.server import (
    ModelProvider,
)
from mlx_lm.utils import load_config

from ..families import get_family
from ..runtime import BudgetError, RuntimeConfig, load
from ..runtime.loader import PREFILL_STEP, MemoryPlan, Shard, budget_for, plan_for
from ..units import count, human_bytes

# Without --decode-concurrency: as many sequences at once as the budget holds,
# up to this many (each one more routes a decode step to up to top-k more experts).
DEFAULT_DECODE_CONCURRENCY = 4
# Request bodies larger than this are refused unread (a long prompt is ~1 MB).
DEFAULT_MAX_BODY = 4 << 20


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerOptions:
    """mlx_lm.server's options that apply to a moestream model (same names).

    decode_concurrency: sequences decoded at once; None: as many as the memory
        budget holds, up to DEFAULT_DECODE_CONCURRENCY.
    prompt_cache_bytes: bound of the prompt cache; None: `prompt_cache_size`
        sequences of `context` tokens, or half of what the budget leaves after
        the minimum for decoding, whichever is less.
    chat_template: a Jinja template, or a file that holds one.
    max_body: the largest request body taken, in bytes (ours, not mlx_lm's):
        a larger one is answered 413 before it is read.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    chat_template: str = ""
    use_default_chat_template: bool = False
    chat_template_args: dict = field(default_factory=dict)
    decode_concurrency: int | None = None
    prompt_concurrency: int = 8
    prefill_step_size: int = PREFILL_STEP
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    allowed_origins: tuple[str, ...] = ("*",)
    max_body: int = DEFAULT_MAX_BODY

    def __post_init__(self) -> None:
        if self.max_body < 1:
            raise ValueError("--max-body must be at least 1 byte.")
        if self.decode_concurrency is not None and self.decode_concurrency < 1:
            raise ValueError("--decode-concurrency must be at least 1.")
        if self.prompt_concurrency < 1:
            raise ValueError("--prompt-concurrency must be at least 1.")
        if not 1 <= self.prefill_step_size <= PREFILL_STEP:
            raise ValueError(
                f"--prefill-step-size must be 1 to {PREFILL_STEP}: the memory plan "
                f"sizes a prefill chunk's activations for {PREFILL_STEP} tokens."
            )
        if self.prompt_cache_size < 0:
            raise ValueError("--prompt-cache-size must be 0 or more.")


@dataclass(frozen=True)
class ServePlan:
    """How the server's memory budget splits between the model and its caches."""

    runtime: RuntimeConfig  # what `load` gets: the budget less the prompt cache
    decode_concurrency: int
    prompt_cache_entries: int
    prompt_cache_bytes: int
    kv_per_sequence: int
    budget: int | None

    def describe(self, plan: MemoryPlan) -> str:
        h, entries = human_bytes, count(self.prompt_cache_entries, "sequence")
        return (
            f"server plan: {count(self.decode_concurrency, 'sequence')} decoded at "
            f"once, prompt cache of up to {entries} in "
            f"{h(self.prompt_cache_bytes)} ({h(self.kv_per_sequence)} per "
            f"{self.runtime.context} tokens); model "
            + plan.describe().removeprefix("memory plan: ")
        )


def plan_server(
    directory: str | Path,
    config: RuntimeConfig,
    options: ServerOptions,
    shard: Shard | None = None,
) -> ServePlan:
    """Fit decode concurrency and the prompt cache into `config`'s budget.

    A concurrency that was asked for is refused when it does not fit; the
    default one is lowered until it does. Reads no weight.
    """
    base = plan_for(directory, replace(config, concurrency=1), shard)  # BudgetError
    kv1 = base.kv_cache
    budget = base.budget  # the default budget when none was given...
    if config.memory_budget is None and base.capacity >= base.num_experts:
        budget = None  # ...unless every expert fits: then load sizes it for c
    entries = options.prompt_cache_size
    model_config = load_config(Path(directory))
    top_k = get_family(model_config).top_k(model_config)
    asked = options.decode_concurrency
    if options.kv_bits is not None:  # mlx_lm.server serves these one at a time
        asked = 1
    candidates = [asked] if asked else range(DEFAULT_DECODE_CONCURRENCY, 0, -1)
    error: BudgetError | None = None
    for c in candidates:
        runtime = replace(config, concurrency=c)
        slots = config.cache_experts or min(base.num_experts, c * top_k)
        try:
            need = budget_for(directory, slots, config.context, runtime, shard)
        except BudgetError as e:  # too few --cache-experts for c sequences
            error = e
            continue
        if budget is None:  # --cache-experts without a budget: nothing to fit
            cache = options.prompt_cache_bytes or max(entries * kv1, 1)
            return ServePlan(runtime, c, entries, cache, kv1, None)
        spare = budget - need
        cache = options.prompt_cache_bytes
        if cache is None:
            cache = max(min(entries * kv1, spare // 2), 1)
        if need + cache <= budget:
            runtime = replace(runtime, memory_budget=budget - cache)
            return ServePlan(runtime, c, entries, cache, kv1, budget)
        error = BudgetError(
            f"Memory budget {human_bytes(budget)} is too small to serve: {c} "
            f"sequences at once need {human_bytes(need)} and the prompt cache "
            f"{human_bytes(cache)}; give --memory-budget "
            f"{human_bytes(need + cache, up=True)} or more, or a smaller "
            "--decode-concurrency, --prompt-cache-bytes or --context."
        )
    assert error is not None
    raise error


class StreamingModelProvider(ModelProvider):
    """mlx_lm.server's ModelProvider, loading the one converted model it serves."""

    def __init__(
        self,
        cli_args: argparse.Namespace,
        model_id: str,
        config: RuntimeConfig,
        pipeline: bool = False,
    ) -> None:
        super().__init__(cli_args)
        self.model_id = model_id
        self.runtime_config = config
        self._model_map[model_id] = cli_args.model
        self.pipeline = pipeline
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise RequestError(400, "Adapters and draft models are not served here.")
        if model_path != self.cli_args.model:
            raise RequestError(404, f"Model {model_path!r} is not served here.")
        self.reset()
        gc.collect()
        mx.clear_cache()
        if self.pipeline:  # this rank's layers; mlx-lm shares the requests
            from ..pipeline import init, load_stage

            model, tokenizer, _ = load_stage(
                model_path, self.runtime_config, init(), None, self._tokenizer_config
            )
        else:
            model, tokenizer = load(
                model_path, self.runtime_config, tokenizer_config=self._tokenizer_config
            )
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))

    def load_default(self) -> None:
        """Load in the generation thread, as mlx_lm.server does; tell the caller."""
        try:
            super().load_default()
        except Exception as e:  # reported by Server.start, which then stops
            self.load_error = e
        finally:
            self.loaded.set()
