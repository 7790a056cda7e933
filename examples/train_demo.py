"""Train a tiny Qwen3-MoE language model on the Python standard library.

The script trains a byte-level BPE tokenizer and a small mixture-of-experts
model (mlx-lm's ``qwen3_moe``) with MLX on the CPU, then exports both in the
Hugging Face hub layout of Qwen3-MoE (bf16 ``model.safetensors`` with one
tensor per expert), so that ``convert-moe`` and ``mlx_lm.load`` can read it.

Usage::

    python examples/train_demo.py --minutes 20

Training runs for a wall-clock budget. The number of steps is calibrated from
the speed of the first steps; pass ``--steps`` to fix it and make a run fully
reproducible (the step count chosen is logged and written to the model card).

Speed note: on Linux the ``mlx[cpu]`` wheel links a reference (netlib) BLAS,
which makes matrix products about 15x slower than OpenBLAS. Preloading an
OpenBLAS ``libblas.so.3`` (for example ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/
openblas-pthread/libblas.so.3`` after ``apt-get install libopenblas0-pthread``)
makes a training step about 6x faster; results then differ in rounding only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_moe import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages"}
# The model saw raw source only: its template hands the text on as it is, so
# run-moe, chat and serve prompt it with what it was trained on.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ message['content'] }}{% endfor %}"
)
UNKNOWN = 10**9  # step count before the budget is calibrated


@dataclass
class Corpus:
    """Token streams of the training and validation files."""

    train: np.ndarray
    val: np.ndarray
    n_train_files: int
    n_val_files: int
    val_bytes: int


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "stdlib-moe")
    p.add_argument("--minutes", type=float, default=20.0, help="training budget")
    p.add_argument("--steps", type=int, default=None, help="fix the step count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load balancing")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


# ---------------------------------------------------------------------------
# Data and tokenizer
# ---------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """Return the standard library's .py files, sorted, minus tests and IDLE."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        f
        for f in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(f.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def read_texts(files: list[Path]) -> list[str]:
    """Read source files as UTF-8 (undecodable bytes become U+FFFD)."""
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose first ids are the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0, "the eos token must have id 0"
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Encode documents into one stream, each document followed by eos."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([*enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)


def build_corpus(vocab_size: int) -> tuple[Tokenizer, Corpus]:
    """Split the files (last 3% held out), train the tokenizer, encode."""
    files = stdlib_files()
    n_val = max(1, round(0.03 * len(files)))
    train_texts = read_texts(files[:-n_val])
    val_texts = read_texts(files[-n_val:])
    tok = train_tokenizer(train_texts, vocab_size)
    corpus = Corpus(
        train=encode(tok, train_texts),
        val=encode(tok, val_texts),
        n_train_files=len(files) - n_val,
        n_val_files=n_val,
        val_bytes=sum(len(t.encode("utf-8")) for t in val_texts),
    )
    return tok, corpus


def sample_batch(
    stream: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int
) -> mx.array:
    """Draw random windows of seq_len + 1 tokens from a token stream."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return mx.array(np.stack([stream[s : s + seq_len + 1] for s in starts]))


def val_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a stream into non-overlapping windows of seq_len + 1 tokens."""
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def model_args(vocab_size: int) -> ModelArgs:
    """The model's hyper-parameters (bf16 weights take about 7 MB)."""
    return ModelArgs(
        model_type="qwen3_moe",
        hidden_size=192,
        num_hidden_layers=4,
        intermediate_size=384,
        num_attention_heads=6,
        num_experts=16,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        norm_topk_prob=True,
    )


def forward_with_router(model: Model, tokens: mx.array) -> tuple[mx.array, list]:
    """Run the model like Model.__call__, also returning each router's logits."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    router_logits = []
    for layer in inner.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        z = layer.post_attention_layernorm(h)
        router_logits.append(layer.mlp.gate(z))
        h = h + layer.mlp(z)
    return model.lm_head(inner.norm(h)), router_logits


def load_balancing_loss(router_logits: list, top_k: int) -> mx.array:
    """Switch-style auxiliary loss, 1.0 when routing is perfectly uniform."""
    losses = []
    for logits in router_logits:
        n_experts = logits.shape[-1]
        probs = mx.softmax(logits.reshape(-1, n_experts), axis=-1, precise=True)
        inds = mx.argpartition(probs, kth=-top_k, axis=-1)[:, -top_k:]
        chosen = (inds[..., None] == mx.arange(n_experts)).sum(axis=1)
        frac = mx.stop_gradient(chosen.mean(axis=0) / top_k)
        losses.append(n_experts * (frac * probs.mean(axis=0)).sum())
    return mx.stack(losses).mean()


def loss_fn(
    model: Model, batch: mx.array, aux_coef: float
) -> tuple[mx.array, mx.array]:
    """Next-token cross entropy plus the weighted load-balancing loss."""
    logits, router_logits = forward_with_router(model, batch[:, :-1])
    ce = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
    aux = load_balancing_loss(router_logits, model.args.num_experts_per_tok)
    return ce + aux_coef * aux, ce


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))


def make_step(model: Model, opt: optim.Optimizer, aux_coef: float):
    """Build a compiled training step returning (total loss, cross entropy)."""
    loss_and_grad = nn.value_and_grad(model, partial(loss_fn, aux_coef=aux_coef))
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch: mx.array) -> tuple[mx.array, mx.array]:
        (loss, ce), grads = loss_and_grad(model, batch)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        opt.update(model, grads)
        return loss, ce

    return step


# ---------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------


def calibrate_steps(step_times: list[float], budget_s: float, elapsed: float) -> int:
    """Estimate how many more steps fit in the budget from recent step times.

    The CPU is shared, so later steps are often slower than the first ones:
    plan for 85% of the remaining time to let the cosine decay finish.
    """
    per_step = float(np.mean(step_times))
    return int(0.85 * (budget_s - elapsed) / per_step)


def log_step(step: int, total: int, loss: mx.array, ce: mx.array, t: float) -> None:
    """Print one line of training progress."""
    print(
        f"step {step:5d}/{total} ce {ce.item():.4f} loss {loss.item():.4f} {t:6.0f}s",
        flush=True,
    )


def train(model: Model, corpus: Corpus, args: argparse.Namespace) -> dict:
    """Train for --steps or for the --minutes budget; return a summary."""
    rng = np.random.default_rng(args.seed)
    opt = optim.AdamW(args.lr, [0.9, 0.95], weight_decay=args.weight_decay)
    step_fn = make_step(model, opt, args.aux_coef)
    total, step, times, history = args.steps or UNKNOWN, 0, [], []
    budget_s, t0 = args.minutes * 60, time.perf_counter()
    while step < total and (args.steps or time.perf_counter() - t0 < budget_s):
        opt.learning_rate = mx.array(lr_at(step, total, args))
        ts = time.perf_counter()
        batch = sample_batch(corpus.train, rng, args.batch_size, args.seq_len)
        loss, ce = step_fn(batch)
        mx.eval(loss, ce, model.state, opt.state)
        times.append(time.perf_counter() - ts)
        step += 1
        if args.steps is None and step == 40:  # the first steps compile
            elapsed = time.perf_counter() - t0
            total = step + calibrate_steps(times[5:], budget_s, elapsed)
            print(f"calibrated: {total} steps fit in {args.minutes:g} min", flush=True)
        if step % args.log_every == 0 or step == total:
            history.append((step, ce.item()))
            log_step(step, total, loss, ce, time.perf_counter() - t0)
    last = [c for _, c in history[-3:]] or [ce.item()]
    return {
        "steps": step,
        "planned_steps": total if total < UNKNOWN else step,
        "seconds": time.perf_counter() - t0,
        "train_ce": float(np.mean(last)),
        "history": history,
    }


def evaluate(model: Model, corpus: Corpus, seq_len: int, batch: int = 16) -> dict:
    """Mean next-token loss over all validation windows, and bits per byte."""
    windows = val_windows(corpus.val, seq_len)
    total = 0.0
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i : i + batch])
        logits = model(x[:, :-1])
        loss = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        total += loss.item()
    n_tokens = windows.shape[0] * seq_len
    nats = total / n_tokens
    tokens_per_byte = len(corpus.val) / corpus.val_bytes
    return {
        "val_loss": nats,
        "val_ppl": math.exp(nats),
        "val_tokens": n_tokens,
        "val_bits_per_byte": nats * tokens_per_byte / math.log(2),
    }


def routing_stats(model: Model, corpus: Corpus, seq_len: int, n_seqs: int = 4) -> list:
    """Per layer: share of selections taken by the top 25% of experts, and
    the chance that an expert used at token t is used again at token t+1."""
    x = mx.array(val_windows(corpus.val, seq_len)[:n_seqs, :-1])
    _, router_logits = forward_with_router(model, x)
    k = model.args.num_experts_per_tok
    stats = []
    for logits in router_logits:
        inds = np.array(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
        n_experts = logits.shape[-1]
        counts = np.bincount(inds.ravel(), minlength=n_experts)
        top = np.sort(counts)[::-1][: max(1, n_experts // 4)]
        onehot = np.zeros((*inds.shape[:2], n_experts), dtype=bool)
        np.put_along_axis(onehot, inds, True, axis=-1)
        reuse = (onehot[:, 1:] & onehot[:, :-1]).sum() / onehot[:, :-1].sum()
        stats.append(
            {
                "top25_share": float(top.sum() / counts.sum()),
                "reuse_next_token": float(reuse),
            }
        )
    return stats


# ---------------------------------------------------------------------------
# Export in the Hugging Face layout
# ---------------------------------------------------------------------------


def hf_weights(model: Model) -> dict[str, mx.array]:
    """Rename mlx-lm weights to HF names, one tensor per expert, in bf16."""
    out = {}
    for name, w in tree_flatten(model.parameters()):
        if ".mlp.switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            proj = proj.removesuffix(".weight")
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = w[e]
        else:
            out[name] = w
    return {k: v.astype(mx.bfloat16) for k, v in sorted(out.items())}


def hf_config(args: ModelArgs) -> dict:
    """config.json of a Qwen3MoeForCausalLM with our hyper-parameters."""
    cfg = {k: v for k, v in vars(args).items() if k != "rope_scaling"}
    cfg.update(
        _name_or_path="stdlib-moe",  # the name the serve page shows
        architectures=["Qwen3MoeForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        hidden_act="silu",
        initializer_range=0.02,
        num_local_experts=args.num_experts,
        output_router_logits=False,
        router_aux_loss_coef=0.01,
        rope_scaling=None,
        rope_parameters={"rope_theta": args.rope_theta, "rope_type": "default"},
        sliding_window=None,
        use_sliding_window=False,
        use_cache=True,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    return dict(sorted(cfg.items()))


def tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, obj: dict) -> None:
    """Write pretty JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export(model: Model, tok: Tokenizer, out: Path) -> None:
    """Write weights, configs and tokenizer in the Hugging Face hub layout."""
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), hf_weights(model), metadata={"format": "pt"}
    )
    write_json(out / "config.json", hf_config(model.args))
    gen = {
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 128,
    }
    write_json(out / "generation_config.json", gen)
    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        tokenizer_config(model.args.max_position_embeddings),
    )


# ---------------------------------------------------------------------------
# Sample and model card
# ---------------------------------------------------------------------------


def sample_text(out: Path, prompt: str, seed: int, max_tokens: int = 120) -> str:
    """Reload the exported directory with mlx-lm and sample a continuation."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(out))
    model.set_dtype(mx.float32)  # compute in float32 on the CPU, as in training
    mx.random.seed(seed)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return prompt + generate(
        model,
        tokenizer,
        ids,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=0.7, top_p=0.95),
    )


def model_card(
    cfg: ModelArgs, run: dict, corpus: Corpus, args: argparse.Namespace
) -> str:
    """A short README.md for the exported model."""
    n_params = run["n_params"]
    chance = cfg.num_experts_per_tok / cfg.num_experts
    blas = " (OpenBLAS preloaded)" if "openblas" in os.getenv("LD_PRELOAD", "") else ""
    reproduce = f"`--steps {run['steps']}` reproduces this run"
    if run["steps"] < run["planned_steps"]:
        reproduce = (
            f"the time budget stopped it before the planned {run['planned_steps']}"
        )
    rows = "\n".join(
        f"| {i} | {s['top25_share']:.3f} | {s['reuse_next_token']:.3f} |"
        for i, s in enumerate(run["routing"])
    )
    return f"""# stdlib-moe

A tiny Qwen3-MoE language model (`Qwen3MoeForCausalLM` layout, bf16) trained
from scratch on the Python {sysconfig.get_python_version()} standard library.
It exists to give `moestream` a small, real, offline mixture-of-experts model
for `make demo` and tests. It writes Python-looking text, nothing more.

- Data: the stdlib's `*.py` files without `test/`, `tests/`, `idlelib/` and
  `site-packages/`, sorted by path; the last 3% of files
  ({corpus.n_val_files}) are held out for validation,
  {corpus.n_train_files} files ({len(corpus.train):,} tokens) for training.
- Tokenizer: byte-level BPE, {cfg.vocab_size} tokens, `<|endoftext|>` (id 0,
  eos and pad), `<|im_start|>`, `<|im_end|>` (unused). Its chat template
  passes the messages' text on as it is (one newline between messages): the
  model saw raw source only, so `run-moe`, `moestream chat` and the serve
  page prompt it with code, and it continues the code.
- Model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size},
  {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads of
  {cfg.head_dim}, {cfg.num_experts} experts per layer, top-{cfg.num_experts_per_tok},
  expert width {cfg.moe_intermediate_size}; {n_params / 1e6:.2f} M parameters.
- Training: MLX on {os.cpu_count()} CPU cores{blas}, float32, AdamW
  (lr {args.lr:g}, warmup {args.warmup}, cosine decay),
  batch {args.batch_size} x {args.seq_len} tokens,
  load-balancing loss weight {args.aux_coef:g}, seed {args.seed};
  {run["steps"]} steps in {run["seconds"] / 60:.1f} min.
- Loss: train {run["train_ce"]:.3f}, validation {run["val_loss"]:.3f} nats/token
  (perplexity {run["val_ppl"]:.1f}, {run["val_bits_per_byte"]:.2f} bits/byte).

Produced by `python examples/train_demo.py --minutes {args.minutes:g}`
({reproduce}).

Routing on {run["routing_tokens"]} validation tokens: share of the top-k
selections taken by the busiest 25% of experts (uniform: 0.25), and the chance
that an expert used at token t is used again at token t+1 (random: {chance:.2f}).

| layer | top-25% share | reuse at t+1 |
|---|---|---|
{rows}

Sample (prompt `def `, temperature 0.7):

```python
{run["sample"]}
```
"""


def main() -> None:
    """Build the data, train, evaluate, export and document the model."""
    args = parse_args()
    mx.random.seed(args.seed)
    tok, corpus = build_corpus(args.vocab_size)
    print(
        f"files: {corpus.n_train_files} train, {corpus.n_val_files} val; tokens: "
        f"{len(corpus.train):,} train, {len(corpus.val):,} val",
        flush=True,
    )
    model = Model(model_args(args.vocab_size))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {n_params:,}", flush=True)
    run = train(model, corpus, args)
    run.update(evaluate(model, corpus, args.seq_len), n_params=n_params)
    print(f"validation loss {run['val_loss']:.4f} (ppl {run['val_ppl']:.2f})")
    run["routing"] = routing_stats(model, corpus, args.seq_len)
    run["routing_tokens"] = 4 * args.seq_len
    export(model, tok, args.out)
    run["sample"] = sample_text(args.out, "def ", args.seed)
    (args.out / "README.md").write_text(model_card(model.args, run, corpus, args))
    print(json.dumps({k: v for k, v in run.items() if k != "history"}, indent=2))


if __name__ == "__main__":
    main()
