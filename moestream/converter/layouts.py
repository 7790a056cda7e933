"""How a checkpoint stores its tensors, and one layer's tensors normalized.

Users arrive with whatever checkpoint they have. `detect` names its layout from
config.json and the tensor names; `Layout.normalize` turns one layer's tensors
into what the family's mlx-lm `sanitize` expects:

- per-expert (`mlp.experts.{e}.gate_proj.weight`, bf16/fp16/fp32): as they are;
- fused/stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I] as transformers >= 5 saves them, the
  transposed [E, H, 2I] / [E, I, H] of some repos, or `experts.gate_proj` [E, I, H]):
  split into per-expert tensors, lazily;
- FP8 block-quantized (`weight` float8_e4m3fn + `weight_scale_inv` per block):
  dequantized to float32, then cast and quantized like any source;
- MLX-quantized (`switch_mlp.*.{weight,scales,biases}`): names are mlx-lm's
  already; `keep_or_dequantize` hands quantized tensors through unchanged, or
  dequantizes an expert projection whose bits differ from the recipe;
- MXFP4 experts as the hub ships gpt_oss (`*_blocks` / `*_scales`, unpacked by
  the family's sanitize): kept bit for bit, in mode mxfp4.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import infer_quant_config

from ..families import (
    build_model,
    layer_index,
    quantize_as_configured,
    switch_modules,
)
from ..formats import Recipe
from ..formats.dtypes import DTYPE_NAMES
from ..formats.recipe import LayerOverride, RecipeError
from .source import Source, SourceError

log = logging.getLogger(__name__)

SUPPORTED = (
    "unquantized bf16/fp16/fp32 (per-expert or fused experts), "
    "fp8 block-quantized (weight_scale_inv), MXFP4 experts (gpt_oss), "
    "and MLX-quantized (affine)"
)
FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Qwen3-FP8 default weight_block_size


@dataclass(frozen=True)
class ExpertNames:
    """A family's per-expert projection names, which fused tensors are split into,
    and the other names a transformers >= 5 fused save changes."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    # transformers >= 5 stores gate and up as one tensor, gate first
    gate_up: str = "gate_up_proj"
    # fused container suffix -> per-expert one, where a family's differ
    # (e.g. {"mlp.experts": "block_sparse_moe.experts"})
    containers: tuple[tuple[str, str], ...] = ()
    # a fused save's name inside a decoder layer -> the hub's (routers, biases)
    renames: tuple[tuple[str, str], ...] = ()
    # split fused experts per expert (False: the hub stacks them too, renamed)
    split: bool = True

    def per_expert(self, container: str) -> str:
        for fused, per_expert in self.containers:
            if container.endswith(fused):
                return container.removesuffix(fused) + per_expert
        return container

    def rename(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A fused save's router and bias names, as the hub has them."""
        if not self.renames:
            return weights
        table = dict(self.renames)
        out = {}
        for k, v in weights.items():
            m = re.match(r"^(.*?\.layers\.\d+\.)(.+)$", k)
            out[m.group(1) + table[m.group(2)] if m and m.group(2) in table else k] = v
        return out

    def describe(self) -> str:
        """The expert layouts read for this family (for error messages)."""
        hub = self.containers[0][1] if self.containers else "mlp.experts"
        fused = self.containers[0][0] if self.containers else "mlp.experts"
        if not self.split:
            return (
                f"the hub's {', '.join(h for _, h in self.renames[:3])}, and "
                f"transformers >= 5's {', '.join(f for f, _ in self.renames[:3])}"
            )
        return (
            f"per-expert {hub}.{{e}}.{{{self.gate},{self.up},{self.down}}}.weight; "
            f"fused {fused}.{self.gate_up} [E, 2I, H] + {fused}.down_proj [E, H, I] "
            "(transformers >= 5) or transposed; stacked "
            f"{hub}.{{{self.gate},{self.up},{self.down}}}.weight [E, out, in]"
        )


# Families whose per-expert names are the default ones; a family whose own
# sanitize reads its fused tensors (qwen3_5_moe, llama4) stays out. Extend per
# family.
EXPERT_NAMES: dict[str, ExpertNames] = {
    **dict.fromkeys(
        [
            "qwen3_moe",
            "qwen2_moe",
            "qwen3_next",
            "olmoe",
            "deepseek",
            "deepseek_v2",
            "deepseek_v3",
            "kimi_k2",
            "glm4_moe",
            "glm4_moe_lite",
            "dots1",
            "hunyuan",
            "bailing_moe",
        ],
        ExpertNames(),
    ),
    "ernie4_5_moe": ExpertNames(
        renames=(
            (
                "mlp.gate.moe_statics.e_score_correction_bias",
                "mlp.moe_statics.e_score_correction_bias",
            ),
        )
    ),
}
# transformers >= 5 moves Mixtral-style blocks from block_sparse_moe to mlp.
_MIXTRAL_STYLE = {
    "gate": "w1",
    "up": "w3",
    "down": "w2",
    "containers": (("mlp.experts", "block_sparse_moe.experts"),),
}
_GRANITE = {
    f"{block}.{fused}": f"block_sparse_moe.{hub}"
    for block in ("block_sparse_moe", "mlp")
    for fused, hub in (
        ("router.weight", "router.layer.weight"),
        ("experts.gate_up_proj", "input_linear.weight"),
        ("experts.down_proj", "output_linear.weight"),
    )
}
# Families whose hub names differ from the default ones.
HUB_EXPERT_NAMES: dict[str, ExpertNames] = {
    "mixtral": ExpertNames(
        **_MIXTRAL_STYLE,
        renames=(("mlp.gate.weight", "block_sparse_moe.gate.weight"),),
    ),
    "phimoe": ExpertNames(
        **_MIXTRAL_STYLE,
        renames=(("mlp.router.weight", "block_sparse_moe.gate.weight"),),
    ),
    "minimax_m2": ExpertNames(
        **_MIXTRAL_STYLE,
        renames=(
            ("mlp.gate.weight", "block_sparse_moe.gate.weight"),
            ("mlp.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
        ),
    ),
    # the hub stacks granite's experts as transformers does, under other names
    "granitemoe": ExpertNames(renames=tuple(_GRANITE.items()), split=False),
}


def expert_names(model_type: str) -> ExpertNames | None:
    return EXPERT_NAMES.get(model_type) or HUB_EXPERT_NAMES.get(model_type)


class Layout:
    """Unquantized per-expert tensors: what every family's sanitize expects."""

    def __init__(self, model: nn.Module, src: Source) -> None:
        self.model = model
        self.src = src
        self.config = src.config
        self.fused = False
        self.interleaved = False
        # the dtype floating weights are cast to (set by the converter)
        self.dtype: mx.Dtype | None = None

    def describe(self) -> str:
        if self.interleaved:
            return "fused expert tensors (gate and up interleaved)"
        return "fused expert tensors" if self.fused else "per-expert tensors"

    def normalize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """One layer's source tensors, renamed for the family's sanitize (lazy)."""
        model_type = self.config.get("model_type", "")
        if model_type == "gpt_oss":
            return self._interleaved(weights)
        names = expert_names(model_type)
        if names is None:
            return weights
        weights = names.rename(weights)
        fused = _fused_tensors(weights, names) if names.split else {}
        if fused:
            self.fused = True
            weights = _split_fused(weights, fused, names, _expert_shapes(self.model))
        return weights

    def _interleaved(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Unquantized gpt_oss experts as transformers stores them."""
        if not any(k.endswith(GPT_OSS_FUSED) for k in weights):
            return weights
        self.fused = True
        self.interleaved = True
        return _split_interleaved(weights, _expert_shapes(self.model))

    def tried(self) -> str:
        """The expert layouts this family is read in (for error messages)."""
        model_type = self.config.get("model_type", "")
        if model_type == "gpt_oss":
            return (
                "MXFP4 mlp.experts.{gate_up,down}_proj_{blocks,scales} (the hub); "
                "unquantized mlp.experts.gate_up_proj [E, H, 2I] (gate and up "
                "interleaved) + down_proj [E, I, H] and their _bias (transformers)"
            )
        names = expert_names(model_type)
        return names.describe() if names else "the hub's names, as mlx-lm reads them"

    def expected_shapes(self, weights: Mapping[str, mx.array]) -> dict[str, tuple]:
        """Parameter shapes the sanitized source must have (the unquantized model)."""
        return {k: tuple(v.shape) for k, v in tree_flatten(self.model.parameters())}

    def quantizes_dense(self) -> bool:
        return True

    def default_dtype(self) -> str | None:
        """The dtype to cast to when --dtype is not given; None: config.json's."""
        return None

    def recipe(self, bits: str | None, group_size: int | None) -> Recipe:
        return Recipe.parse(bits, group_size or 64)

    def keep_or_dequantize(
        self, path: str, module: nn.Module, params: dict, target: dict | bool | None
    ) -> tuple[dict[str, mx.array], dict | None]:
        raise SourceError(
            f"{path} is stored quantized (it has scales), but config.json has no "
            "MLX `quantization` entry; use the checkpoint's own config.json."
        )

    def notes(self) -> list[str]:
        return []


class Fp8Layout(Layout):
    """FP8 e4m3 weights with float32 block scales (DeepSeek-V3 / Qwen3-FP8 style)."""

    def __init__(self, model: nn.Module, src: Source) -> None:
        super().__init__(model, src)
        qc = self.config.get("quantization_config") or {}
        block = qc.get("weight_block_size", list(FP8_BLOCK))
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise SourceError(
                f"config.json has weight_block_size {block}; expected two positive "
                "integers like [128, 128]."
            )
        self.block = tuple(block)

    def cast(self, name: str) -> bool:
        return getattr(self.model, "cast_predicate", lambda _: True)(name)

    def describe(self) -> str:
        bo, bi = self.block
        return f"fp8 e4m3 in {bo}x{bi} blocks (dequantized), {super().describe()}"

    def normalize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        for key in [k for k in weights if k.endswith("_scale_inv")]:
            name = key.removesuffix("_scale_inv")
            if name not in weights:
                raise SourceError(
                    f"Checkpoint has {key} but no {name}; download the complete "
                    "checkpoint."
                )
            w = dequantize_fp8(weights[name], weights.pop(key), self.block, name)
            # cast now, as the converter would after sanitize: stacking the
            # experts then holds them in bf16, not float32
            if self.dtype is not None and self.cast(name):
                w = w.astype(self.dtype)
            weights[name] = w
        for name, w in weights.items():
            if w.dtype == mx.uint8:
                raise SourceError(
                    f"FP8 tensor {name} has no {name}_scale_inv; without its block "
                    "scales it cannot be dequantized. Download the complete checkpoint."
                )
        return super().normalize(weights)


def dequantize_fp8(
    weight: mx.array, scale_inv: mx.array, block: tuple[int, int], name: str = ""
) -> mx.array:
    """float32 `from_fp8(weight) * scale_inv`, one scale per block (edges partial).

    weight [..., out, in] as uint8 (mx.load reads F8_E4M3 so), scale_inv
    [..., ceil(out/bo), ceil(in/bi)]; leading dims (stacked experts) broadcast.
    """
    *lead, m, n = weight.shape
    bo, bi = block
    want = (*lead, -(-m // bo), -(-n // bi))
    if weight.dtype != mx.uint8 or tuple(scale_inv.shape) != want:
        raise SourceError(
            f"FP8 tensor {name} ({weight.dtype}, shape {tuple(weight.shape)}) needs "
            f"uint8/float8 data and {name}_scale_inv of shape {want} for "
            f"{bo}x{bi} blocks, got {tuple(scale_inv.shape)}; check "
            "weight_block_size in config.json."
        )
    w = mx.from_fp8(weight, dtype=mx.float32)
    s = scale_inv.astype(mx.float32)
    # repeat each block's scale over its rows and columns, then cut the edges
    s = mx.repeat(mx.repeat(s, bo, axis=-2), bi, axis=-1)[..., :m, :n]
    return w * s


class MlxLayout(Layout):
    """An mlx-lm checkpoint, quantized already: dense kept, experts kept or redone."""

    def __init__(self, model: nn.Module, src: Source) -> None:
        super().__init__(model, src)
        self.quantization = self.config["quantization"]
        self.kept: dict[str, set[str]] = defaultdict(set)
        self.redone: dict[str, set[str]] = defaultdict(set)

    def describe(self) -> str:
        q = self.quantization
        mode = "" if q.get("mode", "affine") == "affine" else f" {q['mode']}"
        return (
            f"MLX-quantized ({q.get('bits')}-bit{mode}, group size "
            f"{q.get('group_size')})"
        )

    def normalize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights

    def expected_shapes(self, weights: Mapping[str, mx.array]) -> dict[str, tuple]:
        return _shapes_as_loaded(self.config, weights)

    def quantizes_dense(self) -> bool:
        return False  # mlx-lm loads the dense part as stored; so do we

    def default_dtype(self) -> str | None:
        """The scales' dtype: casting nothing keeps the stored bytes."""
        scales = next(
            (n for n in sorted(self.src.files) if n.endswith(".scales")), None
        )
        dtype = self.src.peek([scales])[scales].dtype if scales else None
        return (
            DTYPE_NAMES.get(dtype)
            if dtype in (mx.float16, mx.bfloat16, mx.float32)
            else None
        )

    def source_spec(self, path: str, module: nn.Module, params: Mapping) -> dict:
        """Bits, group size and mode `path` is stored with (as mlx-lm reads it)."""
        spec = self.quantization.get(path)
        if not isinstance(spec, dict):
            spec = infer_quant_config(
                path, module, {f"{path}.{k}": v for k, v in params.items()}
            )
        return {
            "group_size": int(spec["group_size"]),
            "bits": int(spec["bits"]),
            "mode": spec.get("mode", "affine"),
        }

    def recipe(self, bits: str | None, group_size: int | None) -> Recipe:
        """The source's own bits unless --bits / --q-group-size say otherwise."""
        base = self.quantization
        specs: dict[str, dict[int, dict]] = defaultdict(dict)
        for spath, switch in switch_modules(self.model).items():
            for proj in ("gate_proj", "up_proj", "down_proj"):
                path = f"{spath}.{proj}"
                names = [f"{path}.{k}" for k in ("weight", "scales")]
                if all(n in self.src.files for n in names):
                    params = {
                        n.rpartition(".")[2]: v for n, v in self.src.peek(names).items()
                    }
                    specs[proj][layer_index(spath)] = self.source_spec(
                        path, switch[proj], params
                    )
        groups = {s["group_size"] for p in specs.values() for s in p.values()}
        modes = {s["mode"] for p in specs.values() for s in p.values()}
        if modes - {"affine"} and not bits:
            raise SourceError(
                f"The source's experts are quantized in mode(s) {sorted(modes)}; "
                "moestream keeps affine MLX experts only. Pass --bits to re-quantize "
                "them, or convert from the unquantized checkpoint."
            )
        if group_size is None and len(groups) > 1:
            raise SourceError(
                f"The source's experts use group sizes {sorted(groups)}; pass "
                "--q-group-size to re-quantize them to one."
            )
        experts, overrides = {}, []
        for proj, by_layer in sorted(specs.items()):
            experts[proj] = by_layer[min(by_layer)]["bits"]
            overrides += [
                LayerOverride(proj, layer, layer, s["bits"])
                for layer, s in sorted(by_layer.items())
                if s["bits"] != experts[proj]
            ]
        try:
            source = Recipe(
                experts or Recipe().experts,
                group_size or (groups.pop() if groups else int(base["group_size"])),
                tuple(overrides),
                int(base["bits"]),
                int(base["group_size"]),
            )
        except RecipeError as e:
            raise SourceError(
                f"The source is quantized in a way moestream cannot keep ({e}); "
                "convert from the unquantized checkpoint."
            ) from None
        return Recipe.parse(bits, source.group_size, base=source)

    def keep_or_dequantize(
        self, path: str, module: nn.Module, params: dict, target: dict | bool | None
    ) -> tuple[dict[str, mx.array], dict | None]:
        """Stored tensors and their spec; or float weights when the recipe differs.

        `target` is the recipe's spec for an expert projection, None for dense
        modules (kept as stored).
        """
        source = self.source_spec(path, module, params)
        proj = path.rpartition(".")[2]
        if not isinstance(target, dict) or _same(source, target):
            if isinstance(target, dict):
                self.kept[proj].add(f"{source['bits']}-bit")
            return params, source
        self.redone[proj].add(f"{_spec_text(source)} -> {_spec_text(target)}")
        w = mx.dequantize(
            params["weight"],
            params["scales"],
            params.get("biases"),
            group_size=source["group_size"],
            bits=source["bits"],
            mode=source["mode"],
        )
        return {"weight": w, **{k: v for k, v in params.items() if k == "bias"}}, None

    def notes(self) -> list[str]:
        lines = []
        if self.redone:
            lines.append(
                "re-quantized:    "
                + "; ".join(
                    f"{p} ({', '.join(sorted(s))})"
                    for p, s in sorted(self.redone.items())
                )
            )
        kept = sorted(set(self.kept) - set(self.redone))
        if kept:
            lines.append(f"kept as stored:  {', '.join(kept)} and the dense part")
        return lines


class Mxfp4Layout(Layout):
    """Experts shipped in MXFP4 (gpt_oss): kept bit for bit, as mlx-lm loads
    them (no lossy round trip); the unquantized dense part follows the recipe."""

    def describe(self) -> str:
        return "MXFP4 experts (kept as shipped), unquantized dense part"

    def expected_shapes(self, weights: Mapping[str, mx.array]) -> dict[str, tuple]:
        return _shapes_as_loaded(self.config, weights)

    def recipe(self, bits: str | None, group_size: int | None) -> Recipe:
        if bits:
            raise SourceError(
                "This checkpoint's experts ship as MXFP4 and are kept as they are "
                "(re-quantizing them would only lose precision); drop --bits."
            )
        return super().recipe(bits, group_size)

    def keep_or_dequantize(
        self, path: str, module: nn.Module, params: dict, target: dict | bool | None
    ) -> tuple[dict[str, mx.array], dict | None]:
        spec = infer_quant_config(
            path, module, {f"{path}.{k}": v for k, v in params.items()}
        )
        if spec["mode"] != "mxfp4":
            raise SourceError(
                f"{path} is stored as {_spec_text(spec)}, but config.json says "
                "mxfp4; is config.json the one of this checkpoint?"
            )
        return params, spec


def _shapes_as_loaded(config: dict, weights: Mapping[str, mx.array]) -> dict:
    """Parameter shapes of the model quantized as mlx-lm's load would, for these
    tensors."""
    model = build_model(config)
    quantize_as_configured(model, config, dict(weights))
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def _spec_text(spec: dict) -> str:
    mode = spec.get("mode", "affine")
    return f"{spec['bits']}-bit g{spec['group_size']}" + (
        "" if mode == "affine" else f" {mode}"
    )


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b.get(k, "affine" if k == "mode" else None) for k in a)


QUANT_METHODS = {"fp8": Fp8Layout, "mxfp4": Mxfp4Layout}


def detect(model: nn.Module, src: Source) -> Layout:
    """The layout of checkpoint `src` (for `model`, its mlx-lm model)."""
    config = src.config
    if isinstance(config.get("quantization"), dict):
        return MlxLayout(model, src)
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method is not None:
        if method not in QUANT_METHODS:
            raise SourceError(
                f"config.json says the checkpoint is quantized with {method!r}, which "
                f"convert-moe cannot read; it reads {SUPPORTED}. Convert from the "
                "unquantized release."
            )
        return QUANT_METHODS[method](model, src)
    if any(n.endswith("weight_scale_inv") for n in src.files):
        return Fp8Layout(model, src)
    return Layout(model, src)


def _fused_tensors(
    weights: Mapping[str, mx.array], names: ExpertNames
) -> dict[str, tuple[str, str]]:
    """Fused tensor name -> (experts container, projection) for 3-D expert tensors;
    the projection is the family's per-expert name, or its gate_up."""
    targets = {
        names.gate_up: names.gate_up,
        "down_proj": names.down,  # transformers' name whatever the family's
        names.gate: names.gate,
        names.up: names.up,
        names.down: names.down,
    }
    projs = "|".join(map(re.escape, targets))
    pattern = re.compile(rf"^(.+\.experts)\.({projs})(?:\.weight)?$")
    found = {}
    for k, v in weights.items():
        m = pattern.match(k)
        if m and v.ndim == 3:
            found[k] = (m.group(1), targets[m.group(2)])
    return found


def _expert_shapes(model: nn.Module) -> dict[int, tuple[int, int, int]]:
    """Layer -> (experts, intermediate, hidden) of the model's routed experts."""
    return {
        layer_index(p): tuple(m.gate_proj.weight.shape)
        for p, m in switch_modules(model).items()
    }


def _layer_shape(
    container: str, shapes: dict[int, tuple[int, int, int]]
) -> tuple[int, int, int]:
    """A layer's expert shape; layers past the last (multi-token prediction,
    dropped by the family's sanitize) mirror the last MoE layer."""
    layer = layer_index(container)
    if layer in shapes:
        return shapes[layer]
    if shapes and layer > max(shapes):
        return shapes[max(shapes)]
    raise SourceError(
        f"Fused experts {container} are in layer {layer}, which config.json "
        "makes a dense layer; the checkpoint and its config do not match."
    )


def _split_fused(
    weights: dict[str, mx.array],
    fused: dict[str, tuple[str, str]],
    names: ExpertNames,
    shapes: dict[int, tuple[int, int, int]],
) -> dict[str, mx.array]:
    by_container: dict[str, dict[str, str]] = defaultdict(dict)
    for key, (container, proj) in fused.items():
        by_container[container][proj] = key
    for container, projs in by_container.items():
        e, i, h = _layer_shape(container, shapes)
        # out-in ([E, out, in], as nn.Linear) or in-out (transposed) layout
        out_in = {names.gate_up: (2 * i, h), names.gate: (i, h), names.up: (i, h)}
        out_in[names.down] = (h, i)
        orient = {False, True}
        for proj, key in projs.items():
            shape = tuple(weights[key].shape)
            ok = {
                t
                for t in (False, True)
                if shape == (e, *out_in[proj][:: -1 if t else 1])
            }
            if not ok:
                a, b = out_in[proj]
                raise SourceError(
                    f"Fused expert tensor {key} has shape {shape}; config.json implies "
                    f"{(e, a, b)} or {(e, b, a)}. The checkpoint and its config do "
                    "not match."
                )
            orient &= ok
        if not orient:
            raise SourceError(
                f"Fused expert tensors of {container} disagree on orientation "
                f"({', '.join(sorted(projs.values()))}); the checkpoint is "
                "inconsistent."
            )
        transposed = orient == {True}  # ambiguous shapes read as [E, out, in]
        for proj, key in projs.items():
            t = weights.pop(key)
            if transposed:
                t = t.swapaxes(-1, -2)
            parts = (
                {names.gate: t[:, :i], names.up: t[:, i:]}
                if proj == names.gate_up
                else {proj: t}
            )
            out = names.per_expert(container)
            for target, stacked in parts.items():
                for x in range(e):
                    weights[f"{out}.{x}.{target}.weight"] = stacked[x]
    return weights


# Unquantized gpt_oss experts as transformers stores them (GptOssExperts).
GPT_OSS_FUSED = ".mlp.experts.gate_up_proj"


def _split_interleaved(
    weights: dict[str, mx.array], shapes: dict[int, tuple[int, int, int]]
) -> dict[str, mx.array]:
    """gpt_oss's `gate_up_proj` [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]),
    `down_proj` [E, I, H] (x @ W, not W @ x) and their biases -> the stacked
    [E, out, in] names mlx-lm's sanitize hands through unchanged."""
    for key in [k for k in weights if k.endswith(GPT_OSS_FUSED)]:
        container = key.removesuffix(".gate_up_proj")
        e, i, h = _layer_shape(container, shapes)
        want = {
            "gate_up_proj": (e, h, 2 * i),
            "down_proj": (e, i, h),
            "gate_up_proj_bias": (e, 2 * i),
            "down_proj_bias": (e, h),
        }
        t = {}
        for name, shape in want.items():
            full = f"{container}.{name}"
            if full not in weights:
                raise SourceError(
                    f"Checkpoint has {key} but no {full}; download the complete "
                    "checkpoint."
                )
            if tuple(weights[full].shape) != shape:
                raise SourceError(
                    f"Fused expert tensor {full} has shape "
                    f"{tuple(weights[full].shape)}; config.json implies {shape} "
                    "(transformers' gpt_oss layout). The checkpoint and its config "
                    "do not match."
                )
            t[name] = weights.pop(full)
        gate_up, bias = t["gate_up_proj"], t["gate_up_proj_bias"]
        weights[f"{container}.gate_proj.weight"] = gate_up[..., ::2].swapaxes(-1, -2)
        weights[f"{container}.up_proj.weight"] = gate_up[..., 1::2].swapaxes(-1, -2)
        weights[f"{container}.down_proj.weight"] = t["down_proj"].swapaxes(-1, -2)
        weights[f"{container}.gate_proj.bias"] = bias[..., ::2]
        weights[f"{container}.up_proj.bias"] = bias[..., 1::2]
        weights[f"{container}.down_proj.bias"] = t["down_proj_bias"]
    return weights
