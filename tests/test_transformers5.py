"""Checkpoints as transformers 5 saves them, for the 15 MoE families it has.

transformers 5.24's own classes write config.json with `rope_parameters`
(rope_theta, rope_type, partial_rotary_factor, scaling fields) in place of the
top-level keys mlx-lm reads, and rename or drop a few more (T5_CONFIG below,
written out by hand as `PreTrainedConfig.to_dict` gives them for these tiny
models). `save_pretrained` writes the experts under the hub's names by default
and fused with `save_original_format=False` (`fused_save`, after
transformers' conversion_mapping.py). Each case converts the hub form (what
mlx-lm reads natively), the transformers 5 default save and its fused save of
the same weights: the two transformers 5 outputs are byte-identical, their
experts and dense part byte-identical to the hub form's, and the logits
bit-identical to mlx-lm's resident model of the transformers 5 source and of
the hub one. RoPE bases are THETA, which is no family's mlx-lm default, so a
base mlx-lm ignored would show.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from builders.synthetic import HUB_LAYOUTS, random_weights, tiny_model, write_hf_model
from builders.synthetic_sources import read_hf
from click.testing import CliRunner
from helpers import BITS, PROMPT, logits_stepwise, same_files

import moestream
from moestream.cli.convert import main as convert_main
from moestream.converter import SourceError, convert
from moestream.converter.hfconfig import ConfigError, normalize_config
from moestream.families import build_model, mlx_lm_classes, model_args
from moestream.formats import Recipe
from moestream.reference import resident_model

THETA = 50000.0
F32 = "float32"
DEFAULT_ROPE = {"rope_theta": THETA, "rope_type": "default"}

# Per family: the hub config's keys transformers 5.24 does not write, and what
# it writes instead (model-specific keys only; `transformers_version` and
# the generic PreTrainedConfig fields add nothing mlx-lm reads).
T5_CONFIG: dict[str, tuple[tuple[str, ...], dict]] = {
    "qwen3_moe": (
        ("num_experts", "head_dim", "rope_theta", "torch_dtype"),
        {
            "num_local_experts": 8,
            "rope_parameters": DEFAULT_ROPE,
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
        },
    ),
    "qwen2_moe": (
        ("rope_theta", "torch_dtype"),
        {
            "rope_parameters": DEFAULT_ROPE,
            "layer_types": ["full_attention"] * 3,
            "max_window_layers": 28,
            "qkv_bias": True,
            "sliding_window": 0,
        },
    ),
    "qwen3_next": (
        (
            "full_attention_interval",
            "partial_rotary_factor",
            "rope_theta",
            "torch_dtype",
        ),
        {
            "rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 0.25},
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
    ),
    "mixtral": (
        ("rope_theta", "torch_dtype"),
        {"rope_parameters": DEFAULT_ROPE, "head_dim": None, "router_jitter_noise": 0.0},
    ),
    "olmoe": (("rope_theta", "torch_dtype"), {"rope_parameters": DEFAULT_ROPE}),
    "deepseek_v2": (
        ("moe_layer_freq", "rope_scaling", "rope_theta", "scoring_func", "torch_dtype"),
        {
            "rope_parameters": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
                "rope_theta": THETA,
                "rope_type": "yarn",
                "type": "yarn",
            },
            "head_dim": 16,
            "mlp_bias": False,
            "qk_head_dim": 48,
        },
    ),
    "deepseek_v3": (
        (
            "moe_layer_freq",
            "rope_scaling",
            "rope_theta",
            "scoring_func",
            "topk_method",
            "torch_dtype",
        ),
        {
            "rope_parameters": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "rope_theta": THETA,
                "rope_type": "yarn",
                "type": "yarn",
            },
            "head_dim": 16,
            "qk_head_dim": 48,
            "rope_interleave": True,
        },
    ),
    "glm4_moe": (
        (
            "head_dim",
            "partial_rotary_factor",
            "rope_scaling",
            "rope_theta",
            "torch_dtype",
        ),
        {"rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 0.5}},
    ),
    "glm4_moe_lite": (
        (
            "first_k_dense_replace",
            "moe_layer_freq",
            "num_nextn_predict_layers",
            "partial_rotary_factor",
            "rope_scaling",
            "rope_theta",
            "scoring_func",
            "topk_method",
            "torch_dtype",
        ),
        {
            "rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 1.0},
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "qk_head_dim": 48,
            "rope_interleave": True,
        },
    ),
    "dots1": (
        ("head_dim", "rope_theta", "scoring_func", "torch_dtype"),
        {
            "rope_parameters": DEFAULT_ROPE,
            "layer_types": ["full_attention"] * 3,
            "max_window_layers": 62,
            "sliding_window": 4096,
        },
    ),
    # a released MiniMax-M2's rotary_dim 16 becomes partial_rotary_factor 0.5
    "minimax_m2": (
        (
            "qk_norm_type",
            "rope_theta",
            "rotary_dim",
            "scoring_func",
            "shared_intermediate_size",
            "use_qk_norm",
            "use_routing_bias",
            "torch_dtype",
        ),
        {
            "rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 0.5},
            "router_jitter_noise": 0.0,
        },
    ),
    # transformers 5 rewrites original_max_position_embeddings to the full context
    "phimoe": (
        ("rope_scaling", "rope_theta", "torch_dtype"),
        {
            "rope_parameters": {
                "long_factor": [1.0 + 0.5 * i for i in range(16)],
                "long_mscale": 1.243,
                "original_max_position_embeddings": 131072,
                "rope_theta": THETA,
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(16)],
                "short_mscale": 1.243,
                "type": "longrope",
            },
            "original_max_position_embeddings": 131072,
        },
    ),
    "ernie4_5_moe": (
        (
            "head_dim",
            "moe_capacity",
            "moe_gate",
            "moe_use_aux_free",
            "rope_theta",
            "torch_dtype",
        ),
        {"rope_parameters": DEFAULT_ROPE, "moe_norm_min": 1e-12},
    ),
    "granitemoe": (("rope_theta", "torch_dtype"), {"rope_parameters": DEFAULT_ROPE}),
    "gpt_oss": (
        (
            "experts_per_token",
            "quantization_config",
            "rope_scaling",
            "rope_theta",
            "torch_dtype",
        ),
        {
            "rope_parameters": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_theta": THETA,
                "rope_type": "yarn",
                "truncate": False,
            },
            "swiglu_alpha": 1.702,
        },
    ),
}
# The hub config the transformers 5 one stands for (beside rope_theta THETA).
HUB_OVERRIDES = {"phimoe": {"original_max_position_embeddings": 131072}}

# save_pretrained(save_original_format=False): the names inside a decoder layer
# that conversion_mapping.py changes, hub -> fused save, after the experts are
# stacked into experts.gate_up_proj [E, 2I, H] (gate first) and down_proj.
FUSED_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (("block_sparse_moe.", "mlp."),),
    "phimoe": (("block_sparse_moe.", "mlp."), ("mlp.gate.weight", "mlp.router.weight")),
    "minimax_m2": (("block_sparse_moe.", "mlp."),),  # the bias follows the block
    "ernie4_5_moe": (("mlp.moe_statics.", "mlp.gate.moe_statics."),),
    # the hub stacks granite's experts already; transformers renames them
    "granitemoe": (
        (
            "block_sparse_moe.input_linear.weight",
            "block_sparse_moe.experts.gate_up_proj",
        ),
        ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
        ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),
    ),
}
MIXTRAL_STYLE = ("w1", "w3", "w2")
PER_EXPERT = dict.fromkeys(["mixtral", "phimoe", "minimax_m2"], MIXTRAL_STYLE)
# The families run in `make test`; the rest with -m slow.
FAST = {"mixtral", "minimax_m2", "gpt_oss", "granitemoe"}


def families(fast: set[str] = FAST) -> list:
    return [
        f if f in fast else pytest.param(f, marks=pytest.mark.slow)
        for f in sorted(T5_CONFIG)
    ]


def hub_config(family: str) -> dict:
    config = {**HUB_LAYOUTS[family][0], "rope_theta": THETA}
    config |= HUB_OVERRIDES.get(family, {})
    if family == "gpt_oss":  # unquantized: what transformers saves
        del config["quantization_config"]
    return config


def t5_config(family: str) -> dict:
    dropped, written = T5_CONFIG[family]
    config = {k: v for k, v in hub_config(family).items() if k not in dropped}
    return config | {"dtype": "bfloat16", "transformers_version": "5.24.0"} | written


def without_mtp(config: dict, w: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers has no multi-token-prediction layers: it saves none."""
    n = config["num_hidden_layers"]

    def extra(k: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", k)
        return (m is not None and int(m.group(1)) >= n) or k.startswith(
            ("mtp.", "model.mtp_")
        )

    return {k: v for k, v in w.items() if not extra(k)}


def gpt_oss_experts(config: dict, w: dict[str, mx.array]) -> dict[str, mx.array]:
    """Unquantized gpt_oss experts under mlx-lm's stacked names (which its
    sanitize hands through): the per-expert form of the same weights."""
    w = {k: v for k, v in w.items() if not k.endswith(("_blocks", "_scales"))}
    h, e, i = (
        config["hidden_size"],
        config["num_local_experts"],
        config["intermediate_size"],
    )
    shapes = {}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        bias = w.pop(f"{p}.gate_up_proj_bias")
        w[f"{p}.gate_proj.bias"], w[f"{p}.up_proj.bias"] = bias[:, ::2], bias[:, 1::2]
        w[f"{p}.down_proj.bias"] = w.pop(f"{p}.down_proj_bias")
        shapes |= {f"{p}.{n}.weight": (e, i, h) for n in ("gate_proj", "up_proj")}
        shapes[f"{p}.down_proj.weight"] = (e, h, i)
    return w | random_weights(shapes, mx.bfloat16, seed=11)


def fused_save(family: str, w: dict[str, mx.array]) -> dict[str, mx.array]:
    """The same tensors as save_pretrained(save_original_format=False) names them."""
    if family == "gpt_oss":  # GptOssExperts: x @ W with gate and up interleaved
        out = {}
        for k, v in w.items():
            m = re.match(r"(.+\.experts)\.(gate|up|down)_proj\.(weight|bias)$", k)
            if not m:
                out[k] = v
                continue
            p, proj, kind = m.groups()
            if proj == "down":
                out[f"{p}.down_proj" + ("_bias" if kind == "bias" else "")] = (
                    v.swapaxes(1, 2) if kind == "weight" else v
                )
            elif proj == "gate":
                gate, up = v, w[f"{p}.up_proj.{kind}"]
                if kind == "weight":  # [E, H, I] each, then [E, H, 2I] interleaved
                    gate, up = gate.swapaxes(1, 2), up.swapaxes(1, 2)
                both = mx.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)
                out[f"{p}.gate_up_proj" + ("_bias" if kind == "bias" else "")] = both
        return out
    gate, up, down = PER_EXPERT.get(family, ("gate_proj", "up_proj", "down_proj"))
    per_expert = re.compile(rf"(.+\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    stacks: dict[str, dict[str, dict[int, mx.array]]] = {}
    out = {}
    for k, v in w.items():
        m = per_expert.match(k)
        if m:
            p, e, proj = m.groups()
            stacks.setdefault(p, {}).setdefault(proj, {})[int(e)] = v
        else:
            out[k] = v
    for p, projs in stacks.items():
        g, u, d = (
            mx.stack([s[e] for e in sorted(s)])
            for s in map(projs.get, (gate, up, down))
        )
        out[f"{p}.gate_up_proj"] = mx.concatenate([g, u], axis=1)
        out[f"{p}.down_proj"] = d
    for old, new in FUSED_RENAMES.get(family, ()):
        out = {k.replace(old, new): v for k, v in out.items()}
    return out


def write_source(path: Path, config: dict, w: dict, tokenizer_from: Path) -> Path:
    write_hf_model(path, config, w, shards=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # identical bytes
        shutil.copyfile(tokenizer_from / f, path / f)
    return path


@dataclass
class Case:
    family: str
    hub: Path
    default: Path
    fused: Path
    out: dict[str, Path]


@pytest.fixture(scope="module", params=families())
def case(request, tmp_path_factory) -> Case:
    family = request.param
    root = tmp_path_factory.mktemp(f"t5-{family}")
    first = tiny_model(root / "first", family, seed=5)
    _, w = read_hf(first)
    w = without_mtp(hub_config(family), w)
    if family == "gpt_oss":
        w = gpt_oss_experts(hub_config(family), w)
    # gpt_oss has one transformers layout: its default save is the fused one
    default = fused_save(family, w) if family == "gpt_oss" else w
    sources = {
        "hub": write_source(root / "hub", hub_config(family), w, first),
        "default": write_source(root / "default", t5_config(family), default, first),
        "fused": write_source(
            root / "fused", t5_config(family), fused_save(family, w), first
        ),
    }
    out = {}
    for name, src in sources.items():
        out[name] = root / f"out-{name}"
        summary = convert(str(src), out[name], bits=BITS, progress=False)
        if name == "fused" and family != "granitemoe":  # granite: stacked either way
            assert summary.source_layout.startswith("fused expert tensors"), family
        # gpt-oss says truncate: false; mlx-lm's yarn always truncates
        truncates = any("truncate is false" in n for n in summary.notes)
        assert truncates == (family == "gpt_oss"), summary.notes
    return Case(family, sources["hub"], sources["default"], sources["fused"], out)


def test_fused_save_converts_byte_identical(case: Case):
    same_files(case.out["default"], case.out["fused"])


def test_same_weights_as_the_hub_form(case: Case):
    """Experts and dense part byte for byte as from the hub's config and names;
    config.json keeps the source's keys beside the ones mlx-lm reads."""
    a, b = case.out["hub"], case.out["default"]
    for f in sorted(a.rglob("*")):
        if f.is_file() and f.name not in ("config.json", "manifest.json"):
            assert f.read_bytes() == (b / f.relative_to(a)).read_bytes(), f.name
    written = json.loads((b / "config.json").read_text())
    assert written["rope_parameters"] == t5_config(case.family)["rope_parameters"]
    assert written["rope_theta"] == THETA


def test_logits_bit_identical_to_mlx_lm(case: Case):
    """The streaming model computes what mlx-lm computes for the transformers 5
    checkpoint, and that is what it computes for the hub form of it."""
    recipe = Recipe.parse(BITS)
    model, _ = moestream.load(case.out["default"], cache_experts=2, dtype=F32)
    ours = logits_stepwise(model, PROMPT, 3)
    # mlx-lm cannot load transformers' gpt_oss experts itself (its sanitize
    # reads unquantized ones as [E, 2I, H]): the hub form's weights stand in
    sources = [case.hub] if case.family == "gpt_oss" else [case.default, case.hub]
    for src in sources:
        theirs = logits_stepwise(resident_model(src, recipe), PROMPT, 3)
        for step, (x, y) in enumerate(zip(ours, theirs, strict=True)):
            assert mx.array_equal(x, y).item(), f"{case.family} vs {src.name}: {step}"


@pytest.mark.parametrize("family", families({"mixtral"}))
def test_rope_theta_reaches_the_model(family: str, tmp_path: Path):
    """A rope_parameters.rope_theta other than mlx-lm's default changes the
    logits, in the converted model and in the oracle alike."""
    default = model_args(hub_config(family))["rope_theta"].default
    if default is inspect.Parameter.empty:  # mlx-lm requires one: the hub's
        default = HUB_LAYOUTS[family][0]["rope_theta"]
    first = tiny_model(tmp_path / "first", family, seed=5)
    _, w = read_hf(first)
    w = without_mtp(hub_config(family), w)
    if family == "gpt_oss":
        w = gpt_oss_experts(hub_config(family), w)
    logits = {}
    for theta in (THETA, default):
        config = t5_config(family)
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": theta}
        t5 = fused_save(family, w) if family == "gpt_oss" else w
        src = write_source(tmp_path / f"src-{theta}", config, t5, first)
        if family == "gpt_oss":  # mlx-lm reads only the hub form's experts
            hub = {**hub_config(family), "rope_theta": theta}
            oracle = write_source(tmp_path / f"hub-{theta}", hub, w, first)
        else:
            oracle = src
        convert(str(src), tmp_path / f"out-{theta}", bits=BITS, progress=False)
        model, _ = moestream.load(tmp_path / f"out-{theta}", cache_experts=2, dtype=F32)
        ref = resident_model(oracle, Recipe.parse(BITS))
        logits[theta] = model(PROMPT)
        assert mx.array_equal(logits[theta], ref(PROMPT)).item()
    assert default != THETA
    assert not mx.array_equal(logits[THETA], logits[default]).item()


# --- config.json alone ------------------------------------------------------


# ModelArgs fields mlx-lm 0.32's model code declares and never reads (checked).
UNREAD = {
    "dots1": ("scoring_func",),
    "ernie4_5_moe": ("moe_capacity", "moe_use_aux_free"),
}


@pytest.mark.parametrize("family", sorted(T5_CONFIG))
def test_model_args_as_from_the_hub_config(family: str):
    """Every family: mlx-lm builds the same ModelArgs from the transformers 5
    config (normalized) as from the hub one."""
    hub = model_args_from(hub_config(family))
    ours = model_args_from(normalize_config(t5_config(family)))
    module = mlx_lm_classes(hub_config(family))[0].__module__
    for name in UNREAD.get(family, ()):
        source = inspect.getsource(importlib.import_module(module))
        assert not re.search(rf"\.{name}\b", source), f"mlx-lm reads {name} now"
        del hub[name], ours[name]
    assert ours == hub


def model_args_from(config: dict) -> dict:
    """vars(ModelArgs) as mlx-lm's code uses them: head_dim None as
    hidden_size // heads, rope_scaling with one type name and no copy of a
    top-level key."""
    args = vars(mlx_lm_classes(config)[1].from_dict(config))
    if "head_dim" in args and args["head_dim"] is None:  # mlx-lm's fallback
        args["head_dim"] = args["hidden_size"] // args["num_attention_heads"]
    scaling = args.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("type") or scaling.get("rope_type")
        args["rope_scaling"] = {
            "type": kind,
            **{
                k: v
                for k, v in scaling.items()
                if k not in ("type", "rope_type") and args.get(k, ...) != v
            },
        }
    return args


def test_normalized_config_keeps_the_source_keys():
    config = t5_config("qwen3_moe")
    out = normalize_config(config)
    assert {k: out[k] for k in config} == config  # nothing of the source changed
    assert (out["rope_theta"], out["num_experts"], out["head_dim"]) == (THETA, 8, 32)
    assert out["rope_scaling"] is None


def _edit(family: str, **changes) -> dict:
    config = t5_config(family)
    for k, v in changes.items():
        if v is ...:
            config.pop(k, None)
        else:
            config[k] = v
    return config


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize(
    "family, changes, message",
    [
        (
            "qwen3_moe",
            {"rope_parameters": {**DEFAULT_ROPE, **YARN}},
            r"'yarn' RoPE \(rope_parameters.rope_type\).*qwen3_moe does not implement",
        ),
        (
            "mixtral",
            {"rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 0.5}},
            r"partial_rotary_factor 0.5.*mixtral rotates whole heads",
        ),
        (
            "deepseek_v3",
            {"rope_parameters": {**DEFAULT_ROPE, **YARN, "attention_factor": 1.3}},
            r"rope_parameters.attention_factor \(1.3\).*does not read",
        ),
        (
            "deepseek_v2",
            {"rope_parameters": DEFAULT_ROPE},
            r"'default' RoPE .*deepseek_v2 does not implement \(it runs 'yarn'\)",
        ),
        ("mixtral", {"rope_parameters": {"rope_type": "default"}}, r"no rope_theta"),
        (
            "mixtral",
            {"rope_theta": 1e6},
            r"rope_theta 1000000.0 and rope_parameters.rope_theta 50000.0",
        ),
        (
            "gpt_oss",
            {
                "rope_parameters": {
                    "full_attention": DEFAULT_ROPE,
                    "sliding_attention": {**DEFAULT_ROPE, "rope_theta": 1e4},
                }
            },
            r"each layer type its own RoPE",
        ),
        ("gpt_oss", {"swiglu_limit": 5.0}, r"swiglu_limit 5.0; .*fixed at 7.0"),
        ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave False"),
        (
            "qwen3_next",
            {
                "layer_types": ["linear_attention", "full_attention"]
                + ["linear_attention"] * 2
            },
            r"layer_types .* not full attention every n-th layer",
        ),
        (
            "glm4_moe_lite",
            {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
            r"mlp_layer_types .* not dense first layers",
        ),
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 64},
            r"sliding-window attention .*qwen3_moe attends to the whole context",
        ),
        (
            "minimax_m2",
            {"rotary_dim": 8},
            r"rotary_dim 8 and partial_rotary_factor 0.5 \(head_dim 32\)",
        ),
    ],
)
def test_math_mlx_lm_does_not_run_is_refused(family, changes, message):
    with pytest.raises(ConfigError, match=message):
        normalize_config(_edit(family, **changes))


def test_rope_parameters_of_an_unmapped_family_refused():
    """hunyuan has no transformers 5 class: its RoPE keys are mlx-lm's own."""
    config = {**HUB_LAYOUTS["hunyuan"][0], "rope_parameters": DEFAULT_ROPE}
    with pytest.raises(ConfigError, match=r"rope_parameters, which mlx-lm's hunyuan"):
        normalize_config(config)
    assert normalize_config(HUB_LAYOUTS["qwen3_5_moe"][0])  # reads its own


@pytest.mark.parametrize(
    "family, fast",
    [(f, True) for f in ("deepseek_v2", "minimax_m2")]
    + [pytest.param(f, False, marks=pytest.mark.slow) for f in sorted(HUB_LAYOUTS)],
)
def test_no_config_key_makes_a_traceback(family: str, fast: bool):
    """Each key null or missing: mlx-lm's model builds, or one line says which
    key it failed on."""
    base = t5_config(family) if fast else HUB_LAYOUTS[family][0]
    outcomes = {"built": 0, "refused": 0}
    for key in sorted(base):
        for config in (
            {**base, key: None},
            {k: v for k, v in base.items() if k != key},
        ):
            try:
                build_model(normalize_config(config))
                outcomes["built"] += 1
            except ValueError as e:
                assert "\n" not in str(e), str(e)
                outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and outcomes["built"] > 0, outcomes


def test_mlx_lm_build_error_is_one_line_naming_the_key(tmp_path: Path):
    """deepseek_v2 without rope_scaling: mlx-lm's own code raises AttributeError."""
    src = tiny_model(tmp_path / "src", "deepseek_v2", rope_scaling=None)
    r = CliRunner().invoke(convert_main, [str(src), str(tmp_path / "out")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    line = r.output.strip()
    assert "\n" not in line and "rope_scaling" in line and "deepseek_v2" in line
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_names_the_layouts_tried(tmp_path: Path):
    first = tiny_model(tmp_path / "first", "mixtral", seed=5)
    _, w = read_hf(first)
    w = fused_save("mixtral", w)
    w["model.layers.1.mlp.experts.gate_up"] = w.pop(
        "model.layers.1.mlp.experts.gate_up_proj"
    )
    src = write_source(tmp_path / "src", t5_config("mixtral"), w, first)
    with pytest.raises(SourceError) as e:
        convert(str(src), tmp_path / "out", progress=False)
    text = str(e.value)
    assert "Unexpected tensor model.layers.1.mlp.experts.gate_up for mixtral" in text
    assert "block_sparse_moe.experts.{e}.{w1,w3,w2}.weight" in text
    assert "mlp.experts.gate_up_proj [E, 2I, H]" in text


def test_gpt_oss_fused_shape_mismatch_refused(tmp_path: Path):
    """[E, 2I, H] is not transformers' gpt_oss layout: refused, not split wrongly."""
    first = tiny_model(tmp_path / "first", "gpt_oss", seed=5, hidden_size=96)
    config = {**hub_config("gpt_oss"), "hidden_size": 96}
    _, w = read_hf(first)
    w = fused_save("gpt_oss", gpt_oss_experts(config, w))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    w[key] = w[key].swapaxes(1, 2)
    src = write_source(
        tmp_path / "src", t5_config("gpt_oss") | {"hidden_size": 96}, w, first
    )
    with pytest.raises(
        SourceError, match=r"gate_up_proj has shape \(8, 128, 96\).*\(8, 96, 128\)"
    ):
        convert(str(src), tmp_path / "out", progress=False)
