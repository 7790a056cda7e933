"""config.json as transformers >= 5 writes it, turned into what mlx-lm reads.

transformers 5 keeps RoPE in `rope_parameters` (`rope_theta`, `rope_type`,
`partial_rotary_factor`, the scaling fields) instead of top-level `rope_theta`
/ `rope_scaling` / `partial_rotary_factor`, and renames or drops keys mlx-lm's
ModelArgs read (`num_local_experts` for qwen3_moe's `num_experts`; no
`head_dim`, `rotary_dim`, `shared_intermediate_size`,
`full_attention_interval` or `first_k_dense_replace` where its own classes
derive them). ModelArgs ignore keys they do not know and fall back to their
defaults, so without this a checkpoint's RoPE base is silently replaced by
mlx-lm's.

`normalize_config` adds what the family's ModelArgs reads, keeps the source's
own keys beside it, and refuses by name a field that changes the math and that
neither mlx-lm nor this module understands: a RoPE type or scaling field the
family's mlx-lm code does not implement, partial RoPE where it rotates whole
heads, sliding windows where it attends to everything, a constant it fixes.
The converter writes the result to OUT's config.json; the oracle
(moestream.reference) builds mlx-lm's resident model from the same.
"""

from __future__ import annotations

import inspect
from numbers import Real

from ..families import get_family, model_args

# The scaling fields mlx-lm's rope_utils.initialize_rope reads, per RoPE type.
INITIALIZE_ROPE = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    ),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
}
YARN = {"yarn": INITIALIZE_ROPE["yarn"]}
PLAIN = {"default": ()}  # nn.RoPE(head_dim, base=rope_theta): rope_scaling unread

# What each family's mlx-lm model implements: RoPE type -> scaling fields read.
# A family not listed reads its own RoPE keys (text_config, rope_parameters,
# hunyuan's alpha, ...) and is passed through unchecked.
ROPE: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_moe": PLAIN,
    "qwen2_moe": PLAIN,  # ModelArgs accepts a linear rope_scaling, nn.RoPE ignores it
    "qwen3_next": INITIALIZE_ROPE,
    "mixtral": PLAIN,
    "olmoe": INITIALIZE_ROPE,
    "deepseek_v2": YARN,  # DeepseekV2YarnRotaryEmbedding whatever the type
    "deepseek_v3": INITIALIZE_ROPE,
    "kimi_k2": INITIALIZE_ROPE,
    "glm4_moe": PLAIN,
    "glm4_moe_lite": INITIALIZE_ROPE,
    "dots1": INITIALIZE_ROPE,
    "minimax_m2": PLAIN,
    # SuScaledRoPE; original_max_position_embeddings is read from the top level
    "phimoe": {
        "default": (),
        "longrope": (
            "short_factor",
            "long_factor",
            "short_mscale",
            "long_mscale",
            "original_max_position_embeddings",
        ),
    },
    "ernie4_5_moe": PLAIN,  # initialize_rope without a scaling config
    "granitemoe": INITIALIZE_ROPE,
    "gpt_oss": INITIALIZE_ROPE,
}
# Fields that name the RoPE rather than scale it.
ROPE_NAMES = ("rope_type", "type", "rope_theta", "partial_rotary_factor")

# Config fields mlx-lm's model code fixes; any other value is refused.
PINNED: dict[str, dict[str, object]] = {
    "gpt_oss": {"swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    # interleaved ("traditional") RoPE on the rope head dims
    "deepseek_v3": {"rope_interleave": True},
    "kimi_k2": {"rope_interleave": True},
    "glm4_moe_lite": {"rope_interleave": True},
}
# Keys mlx-lm's ModelArgs require that transformers 5 drops because its class
# has no such part: the value that says so.
ABSENT_PARTS: dict[str, dict[str, object]] = {
    # MiniMax-M2 has no shared expert (mlx-lm reads the key, never uses it)
    "minimax_m2": {"shared_intermediate_size": 0},
}
# The names one count of routed experts goes by.
EXPERT_COUNTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
)


class ConfigError(ValueError):
    """A config.json mlx-lm cannot run as the checkpoint says."""


def normalize_config(config: dict) -> dict:
    """`config` plus the keys the family's mlx-lm ModelArgs reads (a new dict)."""
    get_family(config)
    model_type = config["model_type"]
    out = dict(config)
    args = model_args(config)
    if model_type not in ROPE:
        if out.get("rope_parameters") is not None and "rope_parameters" not in args:
            raise ConfigError(
                f"config.json keeps RoPE in rope_parameters, which mlx-lm's "
                f"{model_type} does not read and moestream does not map for it; "
                "write rope_theta / rope_scaling as the hub's config.json has them."
            )
        return out
    _rope_parameters(out)
    _check_rope(out, model_type)
    _rotary(out, model_type, args)
    _fill_counts(out, args)
    _layer_kinds(out, model_type, args)
    for key, value in PINNED.get(model_type, {}).items():
        if key in out and out[key] != value:
            raise ConfigError(
                f"config.json has {key} {out[key]!r}; mlx-lm's {model_type} is "
                f"fixed at {value!r}, so it cannot run this checkpoint."
            )
    for key, value in ABSENT_PARTS.get(model_type, {}).items():
        if key in args and out.get(key) is None:
            out[key] = value
    return out


def rope_notes(config: dict) -> list[str]:
    """What mlx-lm computes otherwise than the config says, yet is converted
    (as mlx_lm itself runs it); shown in the converter's summary."""
    scaling = config.get("rope_scaling") or {}
    if config.get("model_type") in ROPE and scaling.get("truncate") is False:
        return [
            "note:            rope_scaling.truncate is false, but mlx-lm's YarnRoPE "
            "rounds the correction range (truncate true), as mlx_lm itself runs it"
        ]
    return []


def _rope_parameters(out: dict) -> None:
    """transformers 5's `rope_parameters` -> rope_theta / rope_scaling /
    partial_rotary_factor (a different value of the source's own is refused)."""
    params = out.get("rope_parameters")
    if params is None:
        return
    params = _flat(params, out)
    if "rope_theta" not in params:
        raise ConfigError(
            "config.json's rope_parameters has no rope_theta (transformers would "
            "use its class default); add rope_theta to rope_parameters."
        )
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in params:
            continue
        if out.get(key) is not None and out[key] != params[key]:
            raise ConfigError(
                f"config.json has {key} {out[key]!r} and rope_parameters.{key} "
                f"{params[key]!r}; remove the one that is wrong."
            )
        out[key] = params[key]
    kind = params.get("rope_type") or params.get("type") or "default"
    fields = {k: v for k, v in params.items() if k not in ROPE_NAMES}
    scaling = (
        None
        if kind == "default" and not fields
        else {"type": kind, "rope_type": kind, **fields}
    )
    if out.get("rope_scaling") is not None and not _same_scaling(
        out["rope_scaling"], scaling
    ):
        raise ConfigError(
            f"config.json has rope_scaling {out['rope_scaling']} and rope_parameters "
            f"{params}, which disagree; remove the one that is wrong."
        )
    out["rope_scaling"] = scaling
    original = fields.get("original_max_position_embeddings")
    if original is not None:  # phimoe's mlx-lm reads it at the top level
        _agree(out, "original_max_position_embeddings", original, "rope_parameters")


def _flat(params: object, out: dict) -> dict:
    """One RoPE for every layer; per-layer-type dicts only when all are equal."""
    if not isinstance(params, dict):
        raise ConfigError(
            f"config.json's rope_parameters is {params!r}; expected a JSON object."
        )
    layer_types = out.get("layer_types")
    kinds = set(layer_types) if _strings(layer_types) else set()
    nested = [v for k, v in params.items() if k in kinds]
    if not nested:
        return params
    if any(v != nested[0] for v in nested) or len(nested) != len(params):
        raise ConfigError(
            f"config.json gives each layer type its own RoPE (rope_parameters."
            f"{', rope_parameters.'.join(sorted(params))}); mlx-lm's "
            f"{out['model_type']} uses one for all layers."
        )
    return nested[0]


def _same_scaling(a: object, b: dict | None) -> bool:
    if not isinstance(a, dict) or b is None:
        return a == b
    kind = a.get("rope_type") or a.get("type")
    return kind == b["type"] and {
        k: v for k, v in a.items() if k not in ROPE_NAMES
    } == {k: v for k, v in b.items() if k not in ROPE_NAMES}


def _check_rope(out: dict, model_type: str) -> None:
    """The RoPE mlx-lm's model code will compute is the one the config asks for."""
    where = "rope_parameters" if out.get("rope_parameters") else "rope_scaling"
    scaling = out.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(
            f"config.json's rope_scaling is {scaling!r}; expected an object or null."
        )
    scaling = scaling or {}
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if not isinstance(kind, str):
        raise ConfigError(
            f"config.json's {where} has rope_type {kind!r}; expected a name."
        )
    supported = ROPE[model_type]
    if kind not in supported:
        raise ConfigError(
            f"config.json asks for {kind!r} RoPE ({where}.rope_type), which "
            f"mlx-lm's {model_type} does not implement (it runs "
            f"{' / '.join(map(repr, supported))}); it cannot run this checkpoint "
            "as it was trained."
        )
    for field, value in scaling.items():
        if field in ROPE_NAMES or field in supported[kind] or value is None:
            continue
        if field == "truncate" and kind == "yarn":
            continue  # see rope_notes
        raise ConfigError(
            f"config.json sets {where}.{field} ({value!r}), which mlx-lm's "
            f"{model_type} does not read for {kind!r} RoPE; it cannot run this "
            "checkpoint as it was trained."
        )


def _rotary(out: dict, model_type: str, args: dict) -> None:
    """Partial RoPE as mlx-lm's model reads it: a factor, a dimension, or none."""
    factor = out.get("partial_rotary_factor")
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, Real)
    ):
        raise ConfigError(
            f"config.json's partial_rotary_factor is {factor!r}; expected a number."
        )
    reads = {"rotary_dim", "partial_rotary_factor"} & set(args)
    if not reads and factor not in (None, 1, 1.0):
        raise ConfigError(
            f"config.json has partial_rotary_factor {factor}, but mlx-lm's "
            f"{model_type} rotates whole heads; it cannot run this checkpoint."
        )
    head_dim = out.get("head_dim") or _div(out, "hidden_size", "num_attention_heads")
    if not _integer(head_dim):
        return  # mlx-lm's ModelArgs refuses it (build_model says so)
    param = args.get("head_dim")
    if param is not None and param.default in (inspect.Parameter.empty, None):
        out["head_dim"] = head_dim  # as given, else transformers' hidden // heads
    if "rotary_dim" in args and "partial_rotary_factor" not in args:
        # transformers rotates int(head_dim * partial_rotary_factor) dims
        dims = int(head_dim * (1.0 if factor is None else factor))
        if out.get("rotary_dim") is None:
            out["rotary_dim"] = dims
        elif factor is not None and dims != out["rotary_dim"]:
            raise ConfigError(
                f"config.json has rotary_dim {out['rotary_dim']} and "
                f"partial_rotary_factor {factor} (head_dim {head_dim}); remove "
                "the one that is wrong."
            )


def _div(out: dict, a: str, b: str) -> int | None:
    x, y = out.get(a), out.get(b)
    return x // y if _integer(x) and _integer(y) and y else None


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fill_counts(out: dict, args: dict) -> None:
    """The routed-expert count under the name the family's ModelArgs reads."""
    present = [k for k in EXPERT_COUNTS if out.get(k) is not None]
    for key in EXPERT_COUNTS:
        if key in args and out.get(key) is None and present:
            out[key] = out[present[0]]


def _layer_kinds(out: dict, model_type: str, args: dict) -> None:
    """transformers 5's per-layer lists -> the intervals mlx-lm reads."""
    kinds = out.get("layer_types")
    if _strings(kinds) and "full_attention_interval" in args:
        full = [k == "full_attention" for k in kinds]
        n = full.index(True) + 1 if True in full else 0
        if not n or full != [(i + 1) % n == 0 for i in range(len(full))]:
            raise ConfigError(
                f"config.json's layer_types {kinds} is not full attention every "
                f"n-th layer, which is all mlx-lm's {model_type} runs."
            )
        _agree(out, "full_attention_interval", n, "layer_types")
    mlp = out.get("mlp_layer_types")
    if _strings(mlp) and "first_k_dense_replace" in args:
        k = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
        freq = out.get("moe_layer_freq") or 1
        want = [
            "sparse" if i >= k and i % freq == 0 else "dense" for i in range(len(mlp))
        ]
        if mlp != want:
            raise ConfigError(
                f"config.json's mlp_layer_types {mlp} is not dense first layers "
                f"then MoE every {freq}, which is all mlx-lm's {model_type} runs."
            )
        _agree(out, "first_k_dense_replace", k, "mlp_layer_types")
    if _sliding(out) and not {"sliding_window", "layer_types"} & set(args):
        raise ConfigError(
            "config.json asks for sliding-window attention (sliding_window "
            f"{out.get('sliding_window')}, layer_types / use_sliding_window), but "
            f"mlx-lm's {model_type} attends to the whole context; it cannot run "
            "this checkpoint as it was trained."
        )


def _agree(out: dict, key: str, value: int, source: str) -> None:
    if out.get(key) is None:
        out[key] = value
    elif out[key] != value:
        raise ConfigError(
            f"config.json has {key} {out[key]} but its {source} say {value}; "
            "remove the one that is wrong."
        )


def _sliding(out: dict) -> bool:
    """Does any layer attend to a window shorter than the model's context?"""
    kinds = out.get("layer_types")
    if _strings(kinds):
        return "sliding_attention" in kinds
    window = out.get("sliding_window")
    if window is None or out.get("use_sliding_window") is False:
        return False
    context = out.get("max_position_embeddings")
    return not (isinstance(context, int) and isinstance(window, int)) or (
        window < context
    )


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
