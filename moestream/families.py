"""Model families: a thin registry over mlx-lm's model code.

mlx-lm implements each family; moestream only needs to know where a family's
checkpoint keeps a layer's tensors and what mlx-lm's `sanitize` must see to
convert hub names when it is given one layer at a time (every mlx-lm MoE block
calls a `SwitchGLU`, found by type, not by name). Adding a family is one
`Family` entry here, a hub-layout builder in tests/builders/synthetic.py and a
test case in tests/test_families.py; where transformers 5 has a class for it,
also the RoPE its mlx-lm code implements (converter/hfconfig.py `ROPE`), its
fused-save names (converter/layouts.py) and a case in
tests/test_transformers5.py.
"""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, infer_quant_config

# The stored dtypes by manifest name; re-exported for runtime/store.py.
from .formats.dtypes import DTYPE_NAMES as DTYPE_NAMES

# Far above any released model (the deepest have about 130 layers).
MAX_LAYERS = 1024


class UnsupportedModelError(ValueError):
    """A checkpoint whose family moestream does not run."""


@dataclass(frozen=True)
class Family:
    model_type: str
    # Source tensor names of decoder layer N start with this (group 1 = N).
    layer_pattern: str = r"^model\.layers\.(\d+)\."
    # Source tensors mlx-lm's sanitize looks for before it converts hub names
    # (layer 0's experts, any MoE layer's, a conv weight, lm_head): the matches
    # of the first layer having any (or outside layers) are lent to every
    # layer's sanitize, and what they become is dropped.
    probe: str | None = None
    # Lend every layer's matches: granitemoe's sanitize pops each layer's experts.
    probe_all_layers: bool = False
    # Config key of how many experts each token is routed to.
    top_k_key: str = "num_experts_per_tok"

    def top_k(self, config: dict) -> int:
        """Experts per token (text_config first; the most, where it varies by layer)."""
        k = {**config, **config.get("text_config", {})}.get(self.top_k_key, 1)
        return max(k) if isinstance(k, list) else int(k)

    def layer_of(self, name: str) -> int | None:
        m = re.match(self.layer_pattern, name)
        return int(m.group(1)) if m else None

    def probe_names(self, names: Iterable[str]) -> list[str]:
        """The source tensors to lend to every layer's sanitize (maybe none)."""
        if self.probe is None:
            return []
        hits = {n: self.layer_of(n) for n in names if re.search(self.probe, n)}
        if self.probe_all_layers:
            return sorted(hits)
        first = min((i for i in hits.values() if i is not None), default=None)
        return sorted(n for n, i in hits.items() if i == first)

    def sanitize(
        self,
        model: nn.Module,
        weights: dict[str, mx.array],
        lent: dict[str, mx.array] | None = None,
    ) -> dict[str, mx.array]:
        """mlx-lm's own renames and expert stacking, on one layer's tensors.

        `lent`: the probe tensors (lazy, never evaluated), so that sanitize
        takes the same path as on the whole checkpoint.
        """
        if not hasattr(model, "sanitize"):
            return weights
        extra = {k: v for k, v in (lent or {}).items() if k not in weights}
        out = model.sanitize({**weights, **extra})
        if extra:  # keep what this unit's tensors became: its layer's (or none)
            unit = self.layer_of(next(iter(weights))) if weights else None
            out = {k: v for k, v in out.items() if _layer_in(k) == unit}
        return out


# One entry per mlx-lm model_type; `probe` only where its sanitize needs one.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("qwen3_moe"),
        Family("qwen2_moe", probe=r"\.mlp\.experts\."),
        Family("qwen3_next", probe=r"\.mlp\.experts\."),
        Family(
            "qwen3_5_moe",
            layer_pattern=r"^model\.language_model\.layers\.(\d+)\.",
            probe=r"\.linear_attn\.conv1d\.weight$",
        ),
        # experts under block_sparse_moe on the hub, under mlp in a
        # transformers >= 5 fused save: both are probed
        Family("mixtral", probe=r"\.(block_sparse_moe|mlp)\.experts\."),
        Family("olmoe", probe=r"\.mlp\.experts\."),
        Family("deepseek"),
        Family("deepseek_v2"),
        Family("deepseek_v3"),
        Family("kimi_k2"),  # mlx-lm's deepseek_v3
        Family("glm4_moe"),
        Family("glm4_moe_lite"),
        Family("dots1"),
        Family("minimax_m2", probe=r"\.(block_sparse_moe|mlp)\.experts\."),
        Family("phimoe", probe=r"\.(block_sparse_moe|mlp)\.experts\."),
        Family("llama4", layer_pattern=r"^language_model\.model\.layers\.(\d+)\."),
        Family("ernie4_5_moe", top_k_key="moe_k"),
        Family("hunyuan", probe=r"\.mlp\.experts\.", top_k_key="moe_topk"),
        Family("bailing_moe", probe=r"^lm_head\.weight$"),  # norm_head
        Family(
            "granitemoe",
            probe=r"\.(block_sparse_moe|mlp)\.(input_linear|output_linear|experts)\.",
            probe_all_layers=True,
        ),
        Family("gpt_oss"),
    ]
}


def get_family(config: dict) -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        hint = (
            " (its config asks for remote code, which is never run)"
            if config.get("auto_map")
            else ""
        )
        raise UnsupportedModelError(
            f"Model type {model_type!r} is not supported{hint}; "
            f"supported: {', '.join(sorted(FAMILIES))}."
        )
    return FAMILIES[model_type]


def mlx_lm_classes(config: dict) -> tuple[type[nn.Module], type]:
    """The family's mlx-lm (Model, ModelArgs) classes.

    The one call of mlx-lm's private `_get_classes`; tests/test_families.py
    checks it still takes a config and returns these two.
    """
    return _get_classes(config)


def build_model(config: dict) -> nn.Module:
    """The family's mlx-lm model with lazily initialised (never evaluated) weights."""
    get_family(config)
    _check_layer_count(config)
    try:
        model_class, args_class = mlx_lm_classes(config)
        return model_class(args_class.from_dict(config))
    except Exception as e:  # mlx-lm's model code fails on a bad config in many ways
        raise UnsupportedModelError(_build_error(config["model_type"], e)) from None


def model_args(config: dict) -> dict[str, inspect.Parameter]:
    """The fields of the family's mlx-lm ModelArgs (what it reads of config.json)."""
    get_family(config)
    try:
        _, args_class = mlx_lm_classes(config)
        return dict(inspect.signature(args_class).parameters)
    except Exception as e:  # a hostile config.json (e.g. a non-list architectures)
        raise UnsupportedModelError(_build_error(config["model_type"], e)) from None


def _build_error(model_type: str, e: Exception) -> str:
    """One line naming the config key mlx-lm failed on, where it can be told."""
    detail = " ".join(f"{type(e).__name__}: {e}".split())
    key = _missing_argument(e) or _key_read(e)
    where = f" at {key}" if key else ""
    return (
        f"mlx-lm cannot build a {model_type} model from config.json{where} "
        f"({detail}); check {key or 'the config'} in config.json."
    )


def _missing_argument(e: Exception) -> str | None:
    """ModelArgs(...) without a required key: TypeError names it."""
    m = re.search(r"required (?:positional|keyword-only) arguments?: '(\w+)'", str(e))
    return m.group(1) if m else None


def _key_read(e: Exception) -> str | None:
    """The config key read on the failing line of mlx-lm's model code."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "mlx_lm" in f.filename.replace("\\", "/").split("/")
    ]
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str):
        key = e.args[0]
        line = frames[-1].line if frames else ""
        m = re.search(rf"(?:config|args)\.(\w+)\[[\"']{re.escape(key)}", line or "")
        return f"{m.group(1)}.{key}" if m else key
    for frame in reversed(frames):
        m = re.search(r"\b(?:config|args)\.(\w+)", frame.line or "")
        if m:
            return m.group(1)
    return None


def _check_layer_count(config: dict) -> None:
    """mlx-lm builds one Python object per layer: a hostile count exhausts memory."""
    for c in (config, config.get("text_config")):
        n = c.get("num_hidden_layers") if isinstance(c, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_LAYERS:
            raise UnsupportedModelError(
                f"config.json asks for {n} layers (at most {MAX_LAYERS} are "
                "supported); check the config."
            )


def cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters as mlx_lm.convert --dtype does (a no-op when equal)."""
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, v: mx.array) -> mx.array:
        if keep(path) and mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype:
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(cast, model.parameters()))


def quantize_as_configured(
    model: nn.Module, config: dict, weights: dict[str, mx.array]
) -> None:
    """Quantize `model`'s modules as mlx-lm's load_model does for these weights."""
    quantization = config.get("quantization", {})

    def predicate(p: str, m: nn.Module) -> bool | dict:
        if p in quantization:
            return quantization[p]
        if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
            return False
        return infer_quant_config(p, m, weights)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def switch_modules(model: nn.Module) -> dict[str, SwitchGLU]:
    """Every routed-expert module of `model`, by module path."""
    return {p: m for p, m in model.named_modules() if isinstance(m, SwitchGLU)}


def module_at(root: nn.Module, path: str) -> nn.Module:
    node = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def replace_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = module_at(root, parent_path) if parent_path else root
    if isinstance(parent, list):
        parent[int(name)] = new
    else:
        parent[name] = new


def _layer_in(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def layer_index(module_path: str) -> int:
    """The decoder layer an mlx-lm module path belongs to (`...layers.N....`)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", module_path)
    if m is None:
        raise UnsupportedModelError(
            f"Cannot tell the layer of expert module {module_path}."
        )
    return int(m.group(1))
