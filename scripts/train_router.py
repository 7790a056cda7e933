"""Train a small Qwen3-MoE with Qwen3-30B-A3B's expert geometry (128 experts,
top-8) on the Python standard library's source, then record its routing on
held-out text as a trace (layers x tokens x k expert ids).

    python3 scripts/train_router.py --minutes 7 --out /tmp/router

Standalone: torch, transformers 5, tokenizers, numpy (no mlx, no moestream,
no network). Runs on CUDA when there is one (bf16 autocast, fp32 master
weights), else on CPU (for a smoke test at tiny dims). Writes to --out:

    routing.npz      ids uint8 [layers, tokens, k], seq_starts int64 [seqs],
                     ahead uint8 [layers - 1, tokens, --ahead] (layer j+1's
                     router on layer j's MoE input, best first: what the
                     runtime's prefetch predicts),
                     tokens uint16 [tokens] (the held-out token ids),
                     meta (a JSON string: geometry, steps, losses, versions)
    tokenizer.json   the byte-level BPE trained here (or none: --vocab 0)
    model/           the trained weights (save_pretrained, bf16), unless
                     --no-save-model

Corpus: *.py under sysconfig's stdlib (or --corpus-dir), sorted by path,
without test/, tests/, idlelib/, site-packages/; the last 3 % of files are
held out for validation and the trace, as the project's trained tiny
qwen3-moe fixture was. The trace is recorded with the weights of the best validation
loss seen, one causal forward per held-out sequence (the same routing per
token as step-by-step decode), from forward hooks on every layer's router.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ExpertsInterface

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
EOS = 0  # <|endoftext|>: id 0, separates files (as the fixture's tokenizer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=7.0, help="training wall budget")
    p.add_argument("--corpus-dir", type=Path, default=None, help="default: stdlib")
    p.add_argument(
        "--extra-packages",
        default="transformers,torch,numpy",
        help="installed packages whose *.py are added to training only ('': none)",
    )
    p.add_argument("--holdout", type=float, default=0.03, help="share of files")
    p.add_argument("--vocab", type=int, default=8192, help="BPE size; 0: bytes")
    # Qwen3-30B-A3B's expert geometry; the rest small enough for minutes.
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--aux-coef", type=float, default=0.001, help="as Qwen3's")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150, help="steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds")
    p.add_argument("--eval-seqs", type=int, default=64)
    p.add_argument("--trace-seqs", type=int, default=16)
    p.add_argument("--trace-len", type=int, default=512)
    p.add_argument(
        "--ahead", type=int, default=16, help="next-layer predictions kept per token"
    )
    p.add_argument("--max-gpu-gb", type=float, default=20.0, help="hard cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save-model", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if present")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, flush=True)


def corpus_files(root: Path) -> list[Path]:
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if len(files) < 2:
        raise SystemExit(f"error: fewer than 2 *.py files under {root}")
    return files


def package_files(names: str) -> list[Path]:
    """*.py of installed packages (training text only), with the same filter."""
    import importlib.util

    files = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"error: --extra-packages: no installed package {name!r}")
        files += corpus_files(Path(next(iter(spec.submodule_search_locations))))
    return files


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def make_tokenizer(texts: list[str], vocab: int, out: Path):
    """A byte-level BPE trained on the training texts (None: raw bytes)."""
    if vocab == 0:
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def encode(texts: list[str], tok) -> np.ndarray:
    """Files' tokens, each followed by EOS, as one int64 stream."""
    if tok is None:  # bytes 0..255 shift by one: id 0 stays EOS
        parts = [
            np.frombuffer(t.encode(), np.uint8).astype(np.int64) + 1 for t in texts
        ]
    else:
        parts = [np.array(e.ids, np.int64) for e in tok.encode_batch(texts)]
    out = []
    for p in parts:
        out += [p, np.array([EOS], np.int64)]
    return np.concatenate(out)


def bf16_grouped_experts(self, hidden_states, top_k_index, top_k_weights):
    """Experts as two grouped GEMMs in bf16 over fp32 master weights."""
    tokens, hidden = hidden_states.shape
    k = top_k_index.size(-1)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(
        flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1
    )
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = order // k
    x = hidden_states[rows].to(torch.bfloat16)  # (S, D)
    gate_up = F.grouped_mm(
        x, self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs
    )
    gate, up = gate_up.chunk(2, dim=-1)
    h = self.act_fn(gate) * up  # (S, I)
    y = F.grouped_mm(h, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)  # (S, D)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=y.device)
    return out.index_add_(0, rows, y.float()).to(hidden_states.dtype)


def build_model(args: argparse.Namespace, vocab: int) -> Qwen3MoeForCausalLM:
    ExpertsInterface.register("bf16_grouped_mm", bf16_grouped_experts)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # unused: every layer is MoE
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        max_position_embeddings=max(2048, args.seq_len),
        tie_word_embeddings=False,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        experts_implementation="bf16_grouped_mm",
    )
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config)


def lr_at(args: argparse.Namespace, step: int, frac: float) -> float:
    """Linear warmup by steps, then cosine to 10 % over the wall budget."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def batch_of(
    data: torch.Tensor, n: int, seq: int, gen: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq - 1, (n,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def eval_batches(val: torch.Tensor, n: int, seq: int) -> list[torch.Tensor]:
    """Fixed, evenly spaced validation windows."""
    count = min(n, max(1, (len(val) - 1) // seq))
    step = max(seq, (len(val) - seq - 1) // count)
    return [val[i * step : i * step + seq] for i in range(count)]


@torch.no_grad()
def evaluate(model, windows: list[torch.Tensor], device: str, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.stack(windows[i : i + batch]).to(device)
        with autocast(device):
            out = model(input_ids=x, labels=x, output_router_logits=False)
        total += float(out.loss) * len(x)
        count += len(x)
    model.train()
    return total / count


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")


def train(args, model, train_ids, val_windows, device) -> dict:
    """Train for `args.minutes` of wall time; keep the best validation weights."""
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        fused=device == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    start = last_eval = last_log = time.time()
    step, seen, curve, best = 0, 0, [], (float("inf"), None, 0)
    loss_v = aux_v = float("nan")
    while True:
        elapsed = time.time() - start
        done = elapsed >= budget
        if done or elapsed - (last_eval - start) >= args.eval_every or step == 0:
            val = evaluate(model, val_windows, device, args.batch)
            curve.append(
                {
                    "step": step,
                    "tokens": seen,
                    "s": round(elapsed, 1),
                    "train_loss": None if math.isnan(loss_v) else loss_v,
                    "val_loss": val,
                }
            )
            log(f"eval step {step} tokens {seen} val_loss {val:.4f}")
            if val < best[0]:
                state = {
                    k: v.detach().to("cpu", copy=True)
                    for k, v in model.state_dict().items()
                }
                best = (val, state, step)
            last_eval = time.time()
        if done:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(args, step, elapsed / budget)
        x = batch_of(train_ids, args.batch, args.seq_len, gen).to(
            device, non_blocking=True
        )
        with autocast(device):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seen += x.numel()
        if step % 20 == 0 or time.time() - last_log > 15:
            aux_v = out.aux_loss.item()
            loss_v = out.loss.item() - args.aux_coef * aux_v  # cross-entropy alone
            rate = seen / (time.time() - start)
            log(
                f"step {step} loss {loss_v:.4f} aux {aux_v:.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} tok/s {rate:,.0f} {memory(device)}"
            )
            last_log = time.time()
    model.load_state_dict(best[1])
    return {
        "steps": step,
        "tokens": seen,
        "train_s": round(time.time() - start, 1),
        "train_loss": loss_v,
        "aux_loss": aux_v,
        "val_curve": curve,
        "best_val_loss": best[0],
        "best_step": best[2],
    }


def fit_batch(model, batch: int, seq: int, vocab: int) -> int:
    """The largest batch <= `batch` (halving) whose training step fits the GPU cap."""
    while True:
        try:
            x = torch.randint(1, vocab, (batch, seq), device="cuda")
            with autocast("cuda"):
                model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            log(f"batch {batch} x {seq} fits: {memory('cuda')}")
            return batch
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if batch == 1:
                raise
            log(f"batch {batch} x {seq} is out of GPU memory under the cap: halving")
            batch //= 2


def memory(device: str) -> str:
    if device != "cuda":
        return ""
    return f"gpu_peak_gb {torch.cuda.max_memory_allocated() / 2**30:.1f}"


@torch.no_grad()
def record_trace(model, val_ids: torch.Tensor, args, device: str):
    """Top-k ids of every router for evenly spaced held-out sequences, and what
    the runtime's prefetch would predict: layer j+1's router applied to layer
    j's MoE input, its `args.ahead` best experts ranked (moestream's
    `router_predictor`, recorded so a forced trace can drive prefetch)."""
    windows = eval_batches(val_ids, args.trace_seqs, args.trace_len)
    routers = [layer.mlp.gate for layer in model.model.layers]
    caught: list[list[torch.Tensor]] = [[] for _ in routers]
    ahead: list[list[torch.Tensor]] = [[] for _ in routers[1:]]

    def hook(j: int):
        def catch(module, inputs, out):
            caught[j].append(out[2].cpu())
            if j + 1 < len(routers):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
                logits = F.linear(x, routers[j + 1].weight.float())
                ahead[j].append(logits.topk(args.ahead, dim=-1).indices.cpu())

        return catch

    hooks = [r.register_forward_hook(hook(j)) for j, r in enumerate(routers)]
    model.eval()
    try:
        for w in windows:  # one sequence at a time, as decode would see it
            with autocast(device):
                model(input_ids=w[None].to(device), output_router_logits=False)
    finally:
        for h in hooks:
            h.remove()
    ids = torch.stack([torch.cat(c) for c in caught]).numpy()  # (L, T, k)
    if ids.max() > 255 or ids.shape[1] != len(windows) * args.trace_len:
        raise RuntimeError(f"unexpected trace: shape {ids.shape}, max id {ids.max()}")
    predicted = torch.stack([torch.cat(c) for c in ahead]).numpy()  # (L-1, T, A)
    starts = np.arange(len(windows), dtype=np.int64) * args.trace_len
    tokens = torch.cat(windows).numpy()
    return ids.astype(np.uint8), predicted.astype(np.uint8), starts, tokens


def ahead_recall(ids: np.ndarray, ahead: np.ndarray) -> dict:
    """Share of layer j+1's routed experts among the first n of its prediction."""
    k = ids.shape[2]
    nxt = ids[1:, :, :, None]
    return {
        f"recall_at_{n}": float((nxt == ahead[:, :, None, :n]).any(-1).mean())
        for n in sorted({k, k + 2, k + 8, ahead.shape[2]})
        if n <= ahead.shape[2]
    }


def routing_summary(ids: np.ndarray, experts: int) -> dict:
    """The locality numbers the papers report, for a quick look."""
    k = ids.shape[2]
    reuse, top = [], []
    for layer in ids:
        sets = [set(r.tolist()) for r in layer]
        reuse.append(np.mean([len(a & b) / k for a, b in itertools.pairwise(sets)]))
        counts = np.sort(np.bincount(layer.ravel(), minlength=experts))[::-1]
        top.append(counts[: experts // 4].sum() / counts.sum())
    return {
        "p_reuse_next": float(np.mean(reuse)),
        "top25_share": float(np.mean(top)),
        "uniform_p_reuse_next": k / experts,
        "uniform_top25_share": 0.25,
    }


GEOMETRY = (
    "num_experts",
    "num_experts_per_tok",
    "num_hidden_layers",
    "hidden_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "norm_topk_prob",
    "router_aux_loss_coef",
)


def load_corpus(args: argparse.Namespace):
    """Train and held-out token streams, the tokenizer, and what they came from."""
    t0 = time.time()
    root = args.corpus_dir or Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    n_val = max(1, math.ceil(args.holdout * len(files)))
    train_texts, val_texts = read_texts(files[:-n_val]), read_texts(files[-n_val:])
    tok = make_tokenizer(train_texts, args.vocab, args.out)  # on the stdlib part only
    extra = package_files(args.extra_packages)
    train_ids = torch.from_numpy(encode(train_texts + read_texts(extra), tok))
    val_ids = torch.from_numpy(encode(val_texts, tok))
    corpus = {
        "root": str(root),
        "files": len(files),
        "holdout_files": n_val,
        "extra_packages": args.extra_packages,
        "extra_files": len(extra),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "tokenizer": f"byte-level BPE {args.vocab}" if tok else "bytes",
    }
    log(f"corpus: {json.dumps(corpus)}; {time.time() - t0:.0f} s")
    if len(val_ids) < args.trace_len + 2:
        raise SystemExit("error: held-out text shorter than one trace sequence")
    return train_ids, val_ids, (args.vocab if tok else 257), corpus


def build_meta(args, model, corpus: dict, result: dict, ids, ahead, starts) -> dict:
    cuda = args.device == "cuda"
    return {
        "geometry": {k: getattr(model.config, k) for k in GEOMETRY},
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "corpus": corpus,
        "training": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "corpus_dir")},
            **result,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        },
        "trace": {
            "sequences": len(starts),
            "seq_len": args.trace_len,
            "from": "held-out files, evenly spaced windows, best-val weights",
            **routing_summary(ids, args.experts),
            "ahead": ahead_recall(ids, ahead),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
        },
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def setup(args: argparse.Namespace) -> None:
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.experts > 256:
        raise SystemExit("error: --experts over 256 does not fit uint8 ids")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(1.0, args.max_gpu_gb * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(cap)
        torch.set_float32_matmul_precision("high")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup(args)
    train_ids, val_ids, vocab, corpus = load_corpus(args)
    model = build_model(args, vocab).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {n_params / 1e6:.1f} M parameters on {args.device}, "
        f"experts {model.config._experts_implementation}"
    )
    val_windows = eval_batches(val_ids, args.eval_seqs, args.seq_len)
    if args.device == "cuda":
        args.batch = fit_batch(model, args.batch, args.seq_len, vocab)
    result = train(args, model, train_ids, val_windows, args.device)
    ids, ahead, starts, tokens = record_trace(model, val_ids, args, args.device)
    meta = build_meta(args, model, corpus, result, ids, ahead, starts)
    path = args.out / "routing.npz"
    np.savez_compressed(
        path,
        ids=ids,
        ahead=ahead,
        seq_starts=starts,
        tokens=tokens.astype(np.uint16),
        meta=np.array(json.dumps(meta)),
    )
    size = path.stat().st_size / 1e6
    log(f"wrote {path}: ids {ids.shape}, {size:.2f} MB; {json.dumps(meta['trace'])}")
    if not args.no_save_model:
        model.to(torch.bfloat16).save_pretrained(args.out / "model")
        log(f"wrote {args.out / 'model'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
