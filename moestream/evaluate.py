"""moestream eval OUT --data FILE: perplexity, and KL divergence to a reference.

Perplexity is computed as `mlx_lm.perplexity` computes it: the text's tokens
cut into sequences of `context` tokens (the remainder dropped), the model
run on each sequence but its last token, cross-entropy against the next
tokens, perplexity = exp(mean loss) with the delta-method standard error.
With a reference (mlx-lm's model of the unquantized source), the same
sequences also give the mean KL(reference || model) of the next-token
distributions, per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm

from .runtime.loader import resolve_dtype


@dataclass(frozen=True)
class EvalResult:
    sequences: int
    context: int
    tokens: int  # scored (next-token predictions)
    loss: float  # mean cross-entropy, nats per token
    perplexity: float
    perplexity_se: float
    kl: float | None  # mean KL(reference || model), nats per token
    kl_se: float | None
    seconds: float
    tokens_per_second: float

    def as_dict(self) -> dict:
        return asdict(self)


def sequences(
    tokenizer: object, text: str, context: int, limit: int | None = None
) -> mx.array:
    """`text`'s tokens as (N, context) rows, the remainder dropped (as mlx_lm)."""
    if context < 2:
        raise ValueError(f"--context must be at least 2 tokens, got {context}.")
    # verbose=False: a whole file is meant to be longer than the model's context
    ids = tokenizer.encode(text, verbose=False)  # type: ignore[attr-defined]
    n = len(ids) // context
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise ValueError(
            f"The data has {len(ids)} tokens, fewer than one sequence of "
            f"--context {context}; give more text or a smaller --context."
        )
    return mx.array(ids[: n * context]).reshape(n, context)


def _batches(data: mx.array, batch_size: int) -> Iterator[mx.array]:
    for s in range(0, data.shape[0], batch_size):
        yield data[s : s + batch_size]


def evaluate(
    model: nn.Module,
    data: mx.array,
    reference: nn.Module | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> EvalResult:
    """Perplexity of `model` over the rows of `data`, and with `reference`
    the mean KL(reference || model) per token."""
    losses, kls = [], []
    start = time.perf_counter()
    batches = -(-data.shape[0] // batch_size)
    for batch in tqdm(
        _batches(data, batch_size),
        total=batches,
        desc="eval",
        unit="seq" if batch_size == 1 else "batch",
        delay=1.0,
        disable=not progress,
    ):
        logits = model(batch[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="none")
        mx.eval(loss)
        losses.append(loss.flatten())
        if reference is not None:
            ref = reference(batch[:, :-1]).astype(mx.float32)
            log_p = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
            log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            kl = (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1)
            mx.eval(kl)
            kls.append(kl.flatten())
    seconds = time.perf_counter() - start
    all_losses = mx.concatenate(losses)
    mean = all_losses.mean().item()
    ppl = math.exp(mean)
    n = all_losses.size
    se = mx.sqrt(mx.var(all_losses, ddof=1)).item() / math.sqrt(n) if n > 1 else 0.0
    kl_mean = kl_se = None
    if kls:
        all_kl = mx.concatenate(kls)
        kl_mean = all_kl.mean().item()
        kl_se = mx.sqrt(mx.var(all_kl, ddof=1)).item() / math.sqrt(n) if n > 1 else 0
    return EvalResult(
        sequences=data.shape[0],
        context=data.shape[1],
        tokens=n,
        loss=mean,
        perplexity=ppl,
        perplexity_se=ppl * se,
        kl=kl_mean,
        kl_se=kl_se,
        seconds=seconds,
        tokens_per_second=n / seconds if seconds else 0.0,
    )


def load_reference(path: str | Path, stored_dtype: str) -> nn.Module:
    """mlx-lm's model of an unquantized source directory (or an mlx-lm model),
    in the compute dtype the streaming model uses."""
    from mlx_lm.utils import load as mlx_load

    from .families import cast_floating

    model, _ = mlx_load(str(path))
    cast_floating(model, getattr(mx, resolve_dtype("auto", stored_dtype)))
    mx.eval(model.parameters())
    return model.eval()


def format_result(r: EvalResult, name: str) -> str:
    line = (
        f"{name}: perplexity {r.perplexity:.3f} ± {r.perplexity_se:.3f} "
        f"(loss {r.loss:.4f} nats/token) over {r.tokens} tokens "
        f"({r.sequences} x {r.context}), {r.tokens_per_second:.0f} tok/s"
    )
    if r.kl is not None:
        line += f"\nKL(reference || model): {r.kl:.5f} ± {r.kl_se:.5f} nats/token"
    return line


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path} is not UTF-8 text ({e.reason}).") from None
