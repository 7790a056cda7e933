"""moestream eval OUT --data FILE: perplexity, and KL divergence to a reference.

Perplexity is computed as `mlx_lm.perplexity` computes it: the text's tokens
cut into sequences of `context` tokens (the remainder dropped), the model
run on each sequence but its last token, cross-entropy against the next
tokens, perplexity = exp(mean loss) with the delta-method standard error.
With a reference (mlx-lm's model of the unquantized source), the same
sequences also give the mean KL(reference || model) of the next-token
distributions, per token. A model loaded with the fast arithmetic is also run
on the exact path (the same model and slots, `exact_arithmetic`): its
perplexity there and the mean KL(exact || fast).
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
from .runtime.switch import exact_arithmetic


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
    # The fast arithmetic's model on the exact path: its perplexity, and the
    # mean KL(exact || fast) per token.
    exact_perplexity: float | None = None
    kl_exact: float | None = None
    kl_exact_se: float | None = None

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


def _kl(p: mx.array, q: mx.array) -> mx.array:
    """KL(p || q) per position, of logits."""
    log_p = p - mx.logsumexp(p, axis=-1, keepdims=True)
    log_q = q - mx.logsumexp(q, axis=-1, keepdims=True)
    return (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1).flatten()


def _mean_se(parts: list[mx.array]) -> tuple[float, float, int]:
    """Mean, its standard error and the count of the concatenated `parts`."""
    every = mx.concatenate(parts)
    n = every.size
    se = mx.sqrt(mx.var(every, ddof=1)).item() / math.sqrt(n) if n > 1 else 0.0
    return every.mean().item(), se, n


def evaluate(
    model: nn.Module,
    data: mx.array,
    reference: nn.Module | None = None,
    batch_size: int = 1,
    progress: bool = False,
    against_exact: bool = False,
) -> EvalResult:
    """Perplexity of `model` over the rows of `data`; with `reference` the
    mean KL(reference || model) per token; with `against_exact` (a model of
    the fast arithmetic) the exact path's perplexity and KL(exact || model)."""
    losses, kls, exact_losses, exact_kls = [], [], [], []
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
            kls.append(_kl(reference(batch[:, :-1]).astype(mx.float32), logits))
            mx.eval(kls[-1])
        if against_exact:
            with exact_arithmetic(model):
                exact = model(batch[:, :-1]).astype(mx.float32)
            loss = nn.losses.cross_entropy(exact, batch[:, 1:], reduction="none")
            exact_losses.append(loss.flatten())
            exact_kls.append(_kl(exact, logits))
            mx.eval(exact_losses[-1], exact_kls[-1])
    seconds = time.perf_counter() - start
    mean, se, n = _mean_se(losses)
    ppl = math.exp(mean)
    kl_mean, kl_se, _ = _mean_se(kls) if kls else (None, None, 0)
    extra = {}
    if against_exact:
        kl_exact, kl_exact_se, _ = _mean_se(exact_kls)
        exact_ppl = math.exp(_mean_se(exact_losses)[0])
        extra = dict(
            exact_perplexity=exact_ppl, kl_exact=kl_exact, kl_exact_se=kl_exact_se
        )
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
        **extra,
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
    if r.kl_exact is not None:
        line += (
            f"\nexact arithmetic: perplexity {r.exact_perplexity:.3f}; "
            f"KL(exact || fast): {r.kl_exact:.3g} ± {r.kl_exact_se:.2g} nats/token"
        )
    return line


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path} is not UTF-8 text ({e.reason}).") from None
