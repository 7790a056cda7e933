"""Convert a checkpoint: re-quantize experts, write blobs, dense weights, manifest.

One decoder layer at a time: read its tensors lazily, normalize the source's
layout (fused experts, FP8 blocks, MLX-quantized: layouts.py), apply the
family's mlx-lm `sanitize`, cast, quantize every module exactly as mlx-lm's
`quantize_model` would with the recipe's predicate, then write the routed
experts to the layer's blob and keep the rest for the dense safetensors.
"""

from __future__ import annotations

import copy
import errno
import logging
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from .. import __version__
from ..families import (
    Family,
    build_model,
    get_family,
    layer_index,
    module_at,
    switch_modules,
)
from ..formats import (
    BLOCK_ROWS,
    LAYOUTS,
    ExpertLayer,
    Manifest,
    ModelWriter,
    Recipe,
    blocked_layout,
    layer_layout,
    pack_record,
)
from ..formats.dtypes import DTYPE_NAMES, FLOAT_DTYPES, max_abs
from ..formats.manifest import PAGE_SIZE, inside, with_max_abs
from ..units import count, human_bytes, peak_rss
from .hfconfig import rope_notes
from .layouts import Layout, detect
from .relayout import is_converted, relayout
from .resume import (
    JOURNAL_NAME,
    LOCK_NAME,
    Journal,
    ResumeError,
    fingerprint,
    partial_dir,
)
from .source import Source, SourceError, group_by_layer, open_source

log = logging.getLogger(__name__)

DTYPES = FLOAT_DTYPES


@dataclass(frozen=True)
class ConvertSummary:
    out: Path
    moe_layers: int
    experts: int
    record_bytes: tuple[int, int]
    expert_bytes: int
    dense_bytes: int
    expert_bits_per_weight: float
    source_layout: str = ""
    # what happened to already-quantized source tensors (kept / re-quantized)
    notes: tuple[str, ...] = ()
    source_bytes: int = 0
    seconds: float = 0.0
    peak_rss: int = 0
    blocked: bool = False  # records stored blocked (--layout blocked)

    def lines(self) -> list[str]:
        lo, hi = (human_bytes(n) for n in self.record_bytes)
        rate = self.source_bytes / 1e9 / max(self.seconds, 1e-9)
        blocked = f", blocked by {BLOCK_ROWS} rows" if self.blocked else ""
        return [
            f"Wrote {self.out}",
            f"  source:          {self.source_layout}",
            *(f"  {note}" for note in self.notes),
            f"  MoE layers:      {self.moe_layers} x {self.experts} experts",
            f"  expert record:   {lo if lo == hi else f'{lo}-{hi}'}{blocked}",
            f"  experts total:   {human_bytes(self.expert_bytes)} "
            f"({self.expert_bits_per_weight:.2f} bits per weight)",
            f"  dense total:     {human_bytes(self.dense_bytes)}",
            f"  read:            {human_bytes(self.source_bytes)} of source in "
            f"{self.seconds:.1f} s ({rate:.2f} GB/s), peak RSS "
            f"{human_bytes(self.peak_rss)}",
        ]


class ConvertError(ValueError):
    """A conversion that cannot go ahead; the message says what to do."""


def quant_predicate(model: nn.Module, recipe: Recipe) -> Callable:
    """The recipe as an mlx-lm `quant_predicate` (path, module) -> bool | dict.

    `mlx_lm.utils.quantize_model(model, config, recipe.dense_group_size,
    recipe.dense_bits, quant_predicate=...)` with it builds the fully resident
    model this converter's output must match bit for bit.
    """
    family_predicate = getattr(model, "quant_predicate", None)
    experts = {p: layer_index(p) for p in switch_modules(model)}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        parent, _, projection = path.rpartition(".")
        if parent in experts:
            return recipe.expert_spec(projection, experts[parent]).to_mlx()
        return family_predicate(path, module) if family_predicate else True

    return predicate


def convert(
    source: str,
    out: str | Path,
    bits: str | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    revision: str | None = None,
    force: bool = False,
    progress: bool = True,
    resume: bool = False,
    layout: str | None = None,
) -> ConvertSummary:
    """Convert `source` (hub id or directory) into a moestream directory `out`.

    `q_group_size` defaults to 64, or to the source's for an MLX-quantized
    checkpoint, whose bits are also the default recipe (see layouts.py).
    The work happens in `OUT.partial/`, renamed to `out` at the end. With
    `resume`, an interrupted conversion there is finished, reusing its
    finished layers whose checksums verify. `layout` "blocked" stores each
    projection with whole blocks of rows as the CPU kernel reads it (format
    v2, docs/format.md); "rows" (the default) as MLX holds it. A converted
    `source` is rewritten in the `layout` given (relayout.py).
    """
    out = Path(out)
    if is_converted(source):
        others = (bits, q_group_size, dtype, revision, resume)
        return _relayout(Path(source), out, others, force, layout, progress)
    return _convert_checkpoint(
        source,
        out,
        bits,
        q_group_size,
        dtype,
        revision,
        force,
        progress,
        resume,
        layout or "rows",
    )


def _convert_checkpoint(
    source: str,
    out: Path,
    bits: str | None,
    q_group_size: int | None,
    dtype: str | None,
    revision: str | None,
    force: bool,
    progress: bool,
    resume: bool,
    layout: str,
) -> ConvertSummary:
    _check_options(out, bits, q_group_size, dtype, force, resume, layout)
    src = open_source(source, revision)
    start = time.perf_counter()  # after any download: GB/s of reading the source
    family = get_family(src.config)
    model = build_model(src.config)
    reads = detect(model, src)  # how the source's tensors are laid out
    recipe = reads.recipe(bits, q_group_size)
    dtype = dtype or reads.default_dtype() or source_dtype(src.config)
    reads.dtype = getattr(mx, dtype)
    _check_recipe(recipe, model)
    partial = partial_dir(out)
    print_ = fingerprint(src, recipe, dtype, layout)
    journal, done = Journal.open(partial, print_, resume)
    writer = ModelWriter(partial, done.values(), ignore=(JOURNAL_NAME, LOCK_NAME))
    c = Conversion(src, family, model, reads, recipe, dtype, journal, writer, done)
    c.blocked = layout == "blocked"
    try:
        summary = _convert_into(c, progress)
        journal.finish()
        writer.publish(out)
    except BaseException as e:
        kept = journal.abandon()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConvertError(
                _disk_full(e, partial, kept, estimate_output_bytes(model, recipe))
            ) from e
        raise
    for note in summary.notes:
        log.info("%s", " ".join(note.split()))
    return replace(
        summary,
        out=out,
        source_bytes=sum(f.stat().st_size for f in set(src.files.values())),
        seconds=time.perf_counter() - start,
        peak_rss=peak_rss(),
    )


def _relayout(
    source: Path,
    out: Path,
    others: tuple,
    force: bool,
    layout: str | None,
    progress: bool,
) -> ConvertSummary:
    """A converted SOURCE in another --layout (relayout.py): only the layout
    can change, so any other option is refused in one line."""
    if layout is None:
        raise SourceError(
            f"{source} is already a moestream model (it has manifest.json); run it "
            "with run-moe, or give --layout rows or blocked to rewrite its records."
        )
    if any(o not in (None, False) for o in others):
        raise ConvertError(
            f"{source} is already converted: only --layout can change here; convert "
            "the original checkpoint for other --bits, --q-group-size, --dtype, "
            "--revision or --resume."
        )
    if layout not in LAYOUTS:
        raise ConvertError(
            f"Unknown --layout {layout}; use one of {', '.join(LAYOUTS)}."
        )
    _check_destination(out, force)
    if out.resolve() == source.resolve():
        raise ConvertError(
            f"{out} is SOURCE itself; give another folder for the output."
        )
    start = time.perf_counter()
    manifest = relayout(source, out, layout, progress)
    records = [layer.record_nbytes for layer in manifest.layers]
    weights = sum(
        math.prod(seg.shape) * 32 // seg.bits * layer.num_experts
        for layer in manifest.layers
        for seg in layer.segments
        if seg.name.endswith(".weight") and seg.bits
    )
    return ConvertSummary(
        out=out,
        moe_layers=len(manifest.layers),
        experts=manifest.layers[0].num_experts if manifest.layers else 0,
        record_bytes=(min(records, default=0), max(records, default=0)),
        expert_bytes=manifest.expert_bytes,
        dense_bytes=sum(inside(out, f).stat().st_size for f in manifest.dense_files),
        expert_bits_per_weight=8 * manifest.expert_bytes / max(weights, 1),
        source_layout=f"a moestream conversion, its records rewritten as {layout}",
        source_bytes=manifest.expert_bytes,
        seconds=time.perf_counter() - start,
        peak_rss=peak_rss(),
        blocked=manifest.blocked,
    )


def _check_options(
    out: Path,
    bits: str | None,
    q_group_size: int | None,
    dtype: str | None,
    force: bool,
    resume: bool,
    layout: str = "rows",
) -> None:
    """What can be refused before any download."""
    Recipe.parse(bits, q_group_size or 64)  # a typo fails before any download
    if layout not in LAYOUTS:
        raise ConvertError(
            f"Unknown --layout {layout}; use one of {', '.join(LAYOUTS)}."
        )
    _check_destination(out, force)
    if partial_dir(out).exists() and not resume:
        raise ResumeError(
            f"{partial_dir(out)} holds an interrupted conversion; pass --resume to "
            "finish it, or remove it to start over."
        )
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"Unknown --dtype {dtype}; use one of {', '.join(DTYPES)}.")


def _disk_full(e: OSError, partial: Path, kept: bool, estimate: int) -> str:
    free = shutil.disk_usage(partial.parent).free
    where = e.filename or partial
    tail = (
        f"finished layers are kept in {partial}: free space and rerun with --resume, "
        "or remove it"
        if kept
        else "nothing was kept"
    )
    return (
        f"No space left on device writing {where}: the output needs about "
        f"{human_bytes(estimate)}, {human_bytes(free)} is free on "
        f"{partial.parent}; {tail}."
    )


def estimate_output_bytes(model: nn.Module, recipe: Recipe) -> int:
    """About how many bytes the converted model takes (weights, scales, biases)."""
    params = module_quantization(model, recipe)
    total = 0
    for path, module in model.named_modules():
        q = params(path, module)
        for name, w in module.items():
            if not isinstance(w, mx.array):
                continue
            if q is not None and name == "weight":
                q = q if isinstance(q, dict) else recipe.dense.to_mlx()
                total += w.size * q["bits"] // 8 + 2 * 2 * w.size // q["group_size"]
            else:
                total += w.size * 2
    for switch in switch_modules(model).values():  # records padded to whole pages
        experts = max(v.shape[0] for _, v in tree_flatten(switch.parameters()))
        total += PAGE_SIZE + experts * PAGE_SIZE // 2
    return total


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ConvertError(
            f"Cannot save to {out} as it already exists; remove it or pass --force."
        )
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"Cannot save to {out}: cannot create {parent}: {e}.") from e
    if not os.access(parent, os.W_OK):
        raise ConvertError(f"Cannot save to {out}: {parent} is not writable.")


def _check_recipe(recipe: Recipe, model: nn.Module) -> None:
    """A --bits entry that matches nothing in this model is a mistake, not a no-op."""
    switches = switch_modules(model)
    if not switches:
        raise ConvertError(
            "This config describes no MoE layer (num_hidden_layers, "
            "mlp_only_layers, decoder_sparse_step?): no experts to stream."
        )
    projections = sorted(
        {p for m in switches.values() for p in m.children() if hasattr(m[p], "weight")}
    )
    layers = sorted(layer_index(p) for p in switches)
    named = {*recipe.experts, *(o.projection for o in recipe.overrides)}
    for name in sorted(named - set(projections)):
        raise ConvertError(
            f"--bits names {name!r}, but this model's experts have "
            f"{', '.join(projections)}; check the spelling."
        )
    for o in recipe.overrides:
        if not any(o.first <= layer <= o.last for layer in layers):
            raise ConvertError(
                f"--bits range {o.projection}@{o.first}-{o.last} covers no MoE layer "
                f"(they are {layers[0]}-{layers[-1]})."
            )


def source_dtype(config: dict) -> str:
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and isinstance(config.get("text_config"), dict):
        dtype = config["text_config"].get("dtype")
    return dtype if dtype in DTYPES else "float32"


@dataclass
class Conversion:
    """One conversion under way: what is read, how it is cast, where it goes."""

    src: Source
    family: Family
    model: nn.Module
    layout: Layout
    recipe: Recipe
    dtype: str
    journal: Journal
    writer: ModelWriter
    # layers finished by an interrupted run, their blobs verified and kept
    done: dict[int, ExpertLayer]
    # records stored blocked where a projection's rows fill whole blocks
    blocked: bool = False


def _convert_into(c: Conversion, progress: bool) -> ConvertSummary:
    src, model, layout = c.src, c.model, c.layout
    layers, rest = group_by_layer(list(src.files), c.family.layer_of)
    units = [*layers.values(), rest]
    modules = dict(model.named_modules())
    switches = {p: layer_index(p) for p in switch_modules(model)}
    lent = layout.normalize(src.lend(c.family.probe_names(src.files)))
    _check_coverage(c, units, lent)
    predicate = module_quantization(model, c.recipe, layout.quantizes_dense())
    quantization: dict = c.recipe.dense.to_mlx()
    # Finished layers' experts stay lazy, never read: only their dense part is redone.
    skip = tuple(f"{p}." for p, layer in switches.items() if layer in c.done)
    with tqdm(
        total=len(switches),
        initial=len(c.done),
        desc="MoE layers",
        disable=not progress,
    ) as bar:
        for i, names in enumerate(units):
            if i + 1 < len(units):
                src.prefetch(units[i + 1])
            weights = _prepare(c, names, lent)
            out = quantize_unit(weights, modules, predicate, quantization, layout, skip)
            del weights
            mx.eval(out)
            for spath, layer in sorted(switches.items(), key=lambda kv: kv[1]):
                experts = _pop_prefixed(out, spath)
                if experts:
                    entry = _write_layer(c, spath, layer, experts, quantization)
                    c.journal.record(entry)
                    bar.update()
            c.writer.add_dense(out)
    c.writer.close_tensors()
    c.writer.write_config(src.config, quantization)
    for f in src.tokenizer_files():
        c.writer.copy_file(f)
    manifest = c.writer.write_manifest(
        model_type=src.config["model_type"],
        dtype=c.dtype,
        recipe=c.recipe,
        source=_source(src),
        created_by=f"moestream {__version__}",
    )
    summary = _summary(manifest, c.writer.dense_bytes, switches, model)
    notes = (*layout.notes(), *rope_notes(src.config))
    return replace(
        summary,
        source_layout=layout.describe(),
        notes=notes,
        blocked=manifest.blocked,
    )


def _check_coverage(
    c: Conversion, units: list[list[str]], lent: dict[str, mx.array]
) -> None:
    """Before any heavy work: every parameter present with its configured shape."""
    src, family, model, layout = c.src, c.family, c.model, c.layout
    peeked: dict[str, mx.array] = {}
    for names in units:
        try:
            normalized = layout.normalize(src.peek(names))
            peeked.update(family.sanitize(model, normalized, lent))
        except KeyError as e:  # sanitize stacks per-expert tensors by name
            raise SourceError(
                f"Checkpoint is missing tensor {e.args[0]}; download the complete "
                "checkpoint."
            ) from None
    expected = layout.expected_shapes(peeked)
    seen = set()
    for name, w in peeked.items():
        if name not in expected:
            raise SourceError(
                f"Unexpected tensor {name} for {src.config['model_type']} (read as "
                f"{layout.describe()}; {src.config['model_type']} experts are read "
                f"as {layout.tried()}); is config.json the one of this checkpoint?"
            )
        if tuple(w.shape) != expected[name]:
            raise SourceError(
                f"Tensor {name} has shape {tuple(w.shape)} but config.json "
                f"implies {expected[name]}; the checkpoint and its "
                "config do not match."
            )
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise SourceError(
            f"Checkpoint is missing {count(len(missing), 'tensor')} (first: "
            f"{missing[0]}); download the complete checkpoint."
        )


def _prepare(
    c: Conversion, names: list[str], lent: dict[str, mx.array]
) -> dict[str, mx.array]:
    """One unit's tensors, sanitized to mlx-lm names and cast as mlx_lm.convert does."""
    weights = c.family.sanitize(c.model, c.layout.normalize(c.src.take(names)), lent)
    cast = getattr(c.model, "cast_predicate", lambda _: True)
    dtype = getattr(mx, c.dtype)
    return {
        k: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


def module_quantization(
    model: nn.Module, recipe: Recipe, quantize_dense: bool = True
) -> Callable:
    """(path, module) -> mlx quantization dict or None, as `quantize_model` decides.

    Without `quantize_dense` (an MLX-quantized source) only experts are quantized.
    """
    predicate = quant_predicate(model, recipe)
    experts = {f"{s}.{p}" for s, m in switch_modules(model).items() for p in m}

    def params(path: str, module: nn.Module) -> dict | None:
        if not hasattr(module, "to_quantized"):
            return None
        if not quantize_dense and path not in experts:
            return None
        if module.weight.shape[-1] % recipe.dense_group_size != 0:
            return None
        r = predicate(path, module)
        if r is False:
            return None
        return r if isinstance(r, dict) else True

    return params


def quantize_unit(
    weights: dict[str, mx.array],
    modules: dict[str, nn.Module],
    predicate: Callable,
    quantization: dict,
    layout: Layout | None,
    skip: tuple[str, ...] = (),
) -> dict[str, mx.array]:
    """Quantize one unit's modules with `predicate` (from `module_quantization`).

    Per-module specs are recorded in `quantization` (config.json's entry).
    `layout` handles tensors already quantized in the source (None: there are
    none); modules under a `skip` prefix are recorded, not computed.
    """
    by_module: dict[str, dict[str, mx.array]] = defaultdict(dict)
    for key, w in weights.items():
        mpath, _, pname = key.rpartition(".")
        by_module[mpath][pname] = w
    out = {}
    for mpath, params in sorted(by_module.items()):
        module = modules[mpath]
        q = predicate(mpath, module)
        # a resumed layer's experts are on disk: record their spec, compute nothing
        done = f"{mpath}.".startswith(skip)
        if "scales" in params:  # quantized in the source: kept, or dequantized
            params, kept = layout.keep_or_dequantize(mpath, module, params, q)
            if kept is not None:
                base = {k: quantization[k] for k in kept}
                if isinstance(q, dict) or kept != base:
                    quantization[mpath] = kept
                if not done:
                    out.update({f"{mpath}.{k}": v for k, v in params.items()})
                continue
        if isinstance(q, dict):
            quantization[mpath] = q
        if done:
            continue
        if q is None:
            out.update({f"{mpath}.{k}": v for k, v in params.items()})
            continue
        if not isinstance(q, dict):
            q = {k: quantization[k] for k in ("group_size", "bits", "mode")}
        m = copy.copy(module)
        m.update(params)
        qm = m.to_quantized(**q)
        out.update({f"{mpath}.{k}": v for k, v in tree_flatten(qm.parameters())})
    return out


def _pop_prefixed(out: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    keys = [k for k in out if k.startswith(prefix + ".")]
    return {k[len(prefix) + 1 :]: out.pop(k) for k in keys}


def _to_numpy(a: mx.array) -> np.ndarray:
    """Raw storage of `a` (bfloat16 as 16-bit words)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False)


def _write_layer(
    c: Conversion,
    spath: str,
    layer: int,
    experts: dict[str, mx.array],
    quantization: dict,
) -> ExpertLayer:
    num_experts = next(iter(experts.values())).shape[0]
    entry = layer_layout(
        layer,
        spath,
        num_experts,
        [
            (
                name,
                DTYPE_NAMES[a.dtype],
                tuple(a.shape[1:]),
                quantization.get(f"{spath}.{name.rpartition('.')[0]}")
                if name.endswith((".weight", ".scales", ".biases"))
                else None,
            )
            for name, a in experts.items()
        ],
    )
    if c.blocked:
        entry = blocked_layout(entry)
    arrays = {name: _to_numpy(a) for name, a in experts.items()}
    entry = with_max_abs(entry, lambda s: max_abs(arrays[s.name], s.dtype))
    segments, record_nbytes = entry.segments, entry.record_nbytes
    records = (
        pack_record(segments, record_nbytes, {n: a[e] for n, a in arrays.items()})
        for e in range(num_experts)
    )
    log.debug("layer %d: %d experts x %d bytes", layer, num_experts, record_nbytes)
    return c.writer.add_layer(entry, records)


def _source(src: Source) -> dict:
    """The manifest's source: the hub id and revision, and the name the
    source's config.json carries, if any (config.json itself drops it)."""
    named = src.config.get("_name_or_path")
    return {"repo_id": src.repo_id, "revision": src.revision} | (
        {"name": str(named)} if named else {}
    )


def _summary(
    manifest: Manifest, dense_bytes: int, switches: dict[str, int], model: nn.Module
) -> ConvertSummary:
    params = 0
    for spath in switches:
        for _, w in tree_flatten(module_at(model, spath).parameters()):
            if w.ndim == 3:
                params += math.prod(w.shape)
    records = [layer.record_nbytes for layer in manifest.layers]
    return ConvertSummary(
        out=Path(),
        moe_layers=len(manifest.layers),
        experts=manifest.layers[0].num_experts if manifest.layers else 0,
        record_bytes=(min(records, default=0), max(records, default=0)),
        expert_bytes=manifest.expert_bytes,
        dense_bytes=dense_bytes,
        expert_bits_per_weight=8 * manifest.expert_bytes / max(params, 1),
    )
