"""Random MoE checkpoints in real Hugging Face hub layout, for tests.

Tensor names, shapes and config keys are those of the hub's Qwen3-MoE
checkpoints (one 2-D tensor per expert), so the converter sees what a user's
download would give it. Large ones are written one layer per shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from moestream.bench.tokenizer import write_tokenizer
from moestream.families import build_model, switch_modules

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 320,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def mlx_lm_tensors(
    c: dict, experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> dict[str, tuple[int, ...]]:
    """Hub names and shapes read off mlx-lm's own model for `c`, for families whose
    hub names are mlx-lm's but for one tensor per expert (named `experts`)."""
    model = build_model(c)
    hub = dict(zip(("gate_proj", "up_proj", "down_proj"), experts, strict=True))
    switches = switch_modules(model)
    shapes = {}
    for name, w in tree_flatten(model.parameters()):
        switch = next((s for s in switches if name.startswith(f"{s}.")), None)
        if switch is None:
            shapes[name] = tuple(w.shape)
            continue
        proj, _, tensor = name[len(switch) + 1 :].partition(".")
        base = switch.rpartition(".")[0]
        for x in range(w.shape[0]):
            shapes[f"{base}.experts.{x}.{hub[proj]}.{tensor}"] = tuple(w.shape[1:])
    return shapes


# Mixtral-style hubs name the expert projections w1 (gate), w3 (up), w2 (down).
MIXTRAL_EXPERTS = partial(mlx_lm_tensors, experts=("w1", "w3", "w2"))


def random_weights(
    shapes: dict[str, tuple[int, ...]], dtype: mx.Dtype, seed: int = 0
) -> dict[str, mx.array]:
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * mx.random.normal(shape, key=keys[i])
        else:
            scale = 1.0 / shape[-1] ** 0.5
            w = scale * mx.random.normal(shape, key=keys[i])
        out[name] = w.astype(dtype)
    mx.eval(out)
    return out


def write_hf_model(
    path: Path, config: dict, weights: dict[str, mx.array], shards: int = 2
) -> Path:
    """Write config, tokenizer and `shards` safetensors files plus an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    names = sorted(weights)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        fname = (
            f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            if shards > 1
            else "model.safetensors"
        )
        part = {n: weights[n] for n in names[s * per : (s + 1) * per]}
        mx.save_safetensors(str(path / fname), part, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
    return path


def tiny_qwen3_moe(
    path: Path,
    dtype: mx.Dtype = mx.bfloat16,
    seed: int = 0,
    shards: int = 2,
    **overrides: object,
) -> Path:
    config = {**QWEN3_MOE, **overrides}
    weights = random_weights(mlx_lm_tensors(config), dtype, seed)
    return write_hf_model(path, config, weights, shards)


def large_qwen3_moe(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A bigger checkpoint written one decoder layer per shard (bounded memory)."""
    config = {**QWEN3_MOE, "mlp_only_layers": [], **overrides}
    shapes = mlx_lm_tensors(config)
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        key = parts[2] if parts[1] == "layers" else "rest"
        groups.setdefault(key, {})[name] = shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    weight_map = {}
    for i, (_key, group) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        part = random_weights(group, mx.bfloat16, seed + i)
        mx.save_safetensors(str(path / fname), part, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
        del part
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    return path


# ---------------------------------------------------------------- other families
# Tiny random checkpoints with the hub's tensor names and config keys of each
# family mlx-lm runs (names as in the hub's model.safetensors.index.json).

_COMMON = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
}

MIXTRAL = {
    **_COMMON,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
}

QWEN2_MOE = {
    **_COMMON,
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "use_sliding_window": False,
    "rope_theta": 1000000.0,
}

OLMOE = {
    **_COMMON,
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "attention_bias": False,
    "clip_qkv": None,
    "rope_theta": 10000.0,
}

_DEEPSEEK = {
    **_COMMON,
    "num_key_value_heads": 4,
    "max_position_embeddings": 163840,  # 40 x 4096, as the yarn scaling says
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 1.0,
    "rope_theta": 10000.0,
    "attention_bias": False,
}

DEEPSEEK = {
    **_COMMON,
    "architectures": ["DeepseekForCausalLM"],
    "model_type": "deepseek",
    "num_key_value_heads": 4,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
}

DEEPSEEK_V2 = {
    **_DEEPSEEK,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_experts_per_tok": 3,  # top-2 of the best 2 groups of 2 never differs
    "topk_method": "group_limited_greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
}

DEEPSEEK_V3 = {
    **_DEEPSEEK,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "n_shared_experts": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
}

# The hub's yarn `rope_scaling` trips transformers' generic config (it has no
# kimi_k2 class) when the tokenizer loads; routing is what this case is about.
KIMI_K2 = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"},
    "model_type": "kimi_k2",  # mlx-lm runs it as deepseek_v3
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
}

GLM4_MOE_LITE = {
    **_DEEPSEEK,
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,
    "max_position_embeddings": 512,
}

DOTS1 = {
    **_COMMON,
    "architectures": ["Dots1ForCausalLM"],
    "model_type": "dots1",
    "head_dim": 32,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "rope_theta": 10000000,
}

MINIMAX_M2 = {
    **_COMMON,
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",  # mlx-lm runs it as minimax
    "head_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 0,
    "rotary_dim": 16,
    "rope_theta": 5000000,
    "scoring_func": "sigmoid",
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "use_routing_bias": True,
}

PHIMOE = {
    **_COMMON,
    "architectures": ["PhiMoEForCausalLM"],
    "model_type": "phimoe",
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(16)],  # head_dim / 2
        "long_factor": [1.0 + 0.5 * i for i in range(16)],
        "short_mscale": 1.243,
        "long_mscale": 1.243,
    },
    "router_jitter_noise": 0.01,
    "input_jitter_noise": 0.01,
    "attention_bias": True,
    "lm_head_bias": True,
    "sliding_window": 131072,
}

LLAMA4 = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "tie_word_embeddings": False,
    "image_token_index": 310,
    "text_config": {
        **_COMMON,
        "model_type": "llama4_text",
        "max_position_embeddings": 10485760,  # as Llama-4-Scout's
        "attention_bias": False,
        "attention_chunk_size": 32,
        "head_dim": 32,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 64,
        "intermediate_size_mlp": 192,
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    },
    "vision_config": {"hidden_size": 64, "model_type": "llama4_vision_model"},
}

ERNIE4_5_MOE = {
    **_COMMON,
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "head_dim": 32,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "moe_num_experts": 8,
    "moe_num_shared_experts": 2,
    "moe_k": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 2,
    "moe_layer_interval": 1,
    "moe_capacity": [8, 8, 8],
    "moe_gate": "topk",
    "moe_use_aux_free": True,
    "use_bias": False,
    "tie_word_embeddings": True,
    "rope_theta": 500000,
}

HUNYUAN = {
    **_COMMON,
    "architectures": ["HunYuanMoEV1ForCausalLM"],
    "model_type": "hunyuan",
    "intermediate_size": 64,
    "moe_intermediate_size": [64, 64, 64],
    "num_hidden_layers": 3,
    "num_experts": 8,
    "moe_topk": [2, 2, 2],
    "num_shared_expert": [1, 1, 1],
    "use_mixed_mlp_moe": True,
    "use_qk_norm": True,
    "use_cla": False,
    "cla_share_factor": 2,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "alpha": 1000.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "type": "dynamic",
    },
}

BAILING_MOE = {
    **_COMMON,
    "architectures": ["BailingMoeForCausalLM"],
    "model_type": "bailing_moe",
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "norm_head": True,
    "use_qk_norm": True,
    "use_bias": False,
    "use_qkv_bias": False,
    "moe_router_enable_expert_bias": True,
    "score_function": "sigmoid",
    "routed_scaling_factor": 2.5,
    "n_group": 2,
    "topk_group": 1,
    "rope_theta": 600000,
}

GRANITEMOE = {
    **_COMMON,
    "architectures": ["GraniteMoeForCausalLM"],
    "model_type": "granitemoe",
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "logits_scaling": 6.0,
    "rope_theta": 10000.0,
}

GLM4_MOE = {
    **_COMMON,
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "head_dim": 32,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "use_qk_norm": True,
    "attention_bias": True,
}

GPT_OSS = {
    **_COMMON,
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "head_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 32,
    "swiglu_limit": 7.0,
    "max_position_embeddings": 131072,  # 32 x 4096, as the yarn scaling says
    "attention_bias": True,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
}

_LINEAR_ATTENTION = {
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "head_dim": 32,
    "num_hidden_layers": 4,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "attention_bias": False,
}

QWEN3_NEXT = {
    **_COMMON,
    **_LINEAR_ATTENTION,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "mlp_only_layers": [0],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
}

QWEN3_5_MOE = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "image_token_id": 310,
    "video_token_id": 311,
    "tie_word_embeddings": False,
    "text_config": {
        **_COMMON,
        **_LINEAR_ATTENTION,
        "model_type": "qwen3_5_moe_text",
        "dtype": "bfloat16",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
    },
    "vision_config": {"depth": 1, "hidden_size": 64, "model_type": "qwen3_5_moe"},
}


def _lm(c: dict, prefix: str = "model") -> dict[str, tuple[int, ...]]:
    h, v = c["hidden_size"], c["vocab_size"]
    shapes = {f"{prefix}.embed_tokens.weight": (v, h), f"{prefix}.norm.weight": (h,)}
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _norms(p: str, h: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
    }


def _attention(
    p: str, c: dict, bias: bool = False, o_bias: bool = False, q_factor: int = 1
) -> dict[str, tuple[int, ...]]:
    h, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nh
    a = f"{p}.self_attn"
    shapes = {
        f"{a}.q_proj.weight": (nh * hd * q_factor, h),
        f"{a}.k_proj.weight": (nkv * hd, h),
        f"{a}.v_proj.weight": (nkv * hd, h),
        f"{a}.o_proj.weight": (h, nh * hd),
    }
    if bias:
        shapes.update(
            {
                f"{a}.q_proj.bias": (nh * hd,),
                f"{a}.k_proj.bias": (nkv * hd,),
                f"{a}.v_proj.bias": (nkv * hd,),
            }
        )
    if o_bias:
        shapes[f"{a}.o_proj.bias"] = (h,)
    return shapes


def _mlp(p: str, h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}.gate_proj.weight": (i, h),
        f"{p}.up_proj.weight": (i, h),
        f"{p}.down_proj.weight": (h, i),
    }


def _experts(
    p: str,
    e: int,
    h: int,
    i: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    shapes = {}
    for x in range(e):
        shapes[f"{p}.experts.{x}.{gate}.weight"] = (i, h)
        shapes[f"{p}.experts.{x}.{up}.weight"] = (i, h)
        shapes[f"{p}.experts.{x}.{down}.weight"] = (h, i)
    return shapes


def _routed_mlp(p: str, c: dict) -> dict[str, tuple]:
    """DeepSeek-style MoE MLP: a gate (with score-correction bias for noaux_tc
    routing), routed experts and shared experts."""
    h, e, i = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    shapes = {f"{p}.mlp.gate.weight": (e, h)}
    if c.get("topk_method", "noaux_tc") == "noaux_tc":
        shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
    shapes |= _experts(f"{p}.mlp", e, h, i)
    shapes |= _mlp(f"{p}.mlp.shared_experts", h, i * c["n_shared_experts"])
    return shapes


def _mtp_layer(p: str, c: dict) -> dict[str, tuple[int, ...]]:
    """What a multi-token-prediction layer has beside a decoder layer's tensors."""
    h, v = c["hidden_size"], c["vocab_size"]
    return {
        f"{p}.eh_proj.weight": (h, 2 * h),
        f"{p}.enorm.weight": (h,),
        f"{p}.hnorm.weight": (h,),
        f"{p}.shared_head.head.weight": (v, h),
        f"{p}.shared_head.norm.weight": (h,),
    }


def _latent_attention(p: str, c: dict) -> dict[str, tuple[int, ...]]:
    """DeepSeek's multi-head latent attention."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    kvr, qr = c["kv_lora_rank"], c["q_lora_rank"]
    a = f"{p}.self_attn"
    shapes = {
        f"{a}.kv_a_proj_with_mqa.weight": (kvr + c["qk_rope_head_dim"], h),
        f"{a}.kv_a_layernorm.weight": (kvr,),
        f"{a}.kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), kvr),
        f"{a}.o_proj.weight": (h, nh * c["v_head_dim"]),
    }
    if qr:
        shapes[f"{a}.q_a_proj.weight"] = (qr, h)
        shapes[f"{a}.q_a_layernorm.weight"] = (qr,)
        shapes[f"{a}.q_b_proj.weight"] = (nh * qk, qr)
    else:
        shapes[f"{a}.q_proj.weight"] = (nh * qk, h)
    return shapes


def deepseek_tensors(c: dict, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash: latent attention, shared experts,
    dense first layers; `mtp`: the hub's multi-token-prediction layer after the
    last (GLM's; mlx-lm drops DeepSeek-V3's by its number, 61, only)."""
    n = c["num_hidden_layers"]
    shapes = _lm(c)
    for layer in range(n + (c["num_nextn_predict_layers"] if mtp else 0)):
        p = f"model.layers.{layer}"
        shapes |= _norms(p, c["hidden_size"]) | _latent_attention(p, c)
        if layer < c["first_k_dense_replace"] or layer % c["moe_layer_freq"]:
            shapes |= _mlp(f"{p}.mlp", c["hidden_size"], c["intermediate_size"])
        else:
            shapes |= _routed_mlp(p, c)
        if layer >= n:
            shapes |= _mtp_layer(p, c)
    return shapes


def glm4_moe_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """GLM-4.5: dense first layers, shared experts, and a multi-token-prediction
    layer after the last one (mlx-lm drops it)."""
    h, hd, n = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    shapes = _lm(c)
    for layer in range(n + c["num_nextn_predict_layers"]):
        p = f"model.layers.{layer}"
        shapes |= _norms(p, h) | _attention(p, c, bias=True)
        shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        if layer < c["first_k_dense_replace"]:
            shapes |= _mlp(f"{p}.mlp", h, c["intermediate_size"])
        else:
            shapes |= _routed_mlp(p, c)
        if layer >= n:
            shapes |= _mtp_layer(p, c)
    return shapes


def llama4_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """Llama 4: a vision-language checkpoint whose text model keeps each MoE
    layer's experts in two 3-D tensors, `[E, hidden, 2 x inter]` and
    `[E, inter, hidden]`, beside a shared expert."""
    t = c["text_config"]
    h, e, i = t["hidden_size"], t["num_local_experts"], t["intermediate_size"]
    shapes = _lm(t, "language_model.model")
    shapes["language_model.lm_head.weight"] = shapes.pop("lm_head.weight")
    for layer in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}"
        shapes |= _norms(p, h) | _attention(p, t)
        f = f"{p}.feed_forward"
        if layer % t["interleave_moe_layer_step"] != t["interleave_moe_layer_step"] - 1:
            shapes |= _mlp(f, h, t["intermediate_size_mlp"])
            continue
        shapes[f"{f}.router.weight"] = (e, h)
        shapes[f"{f}.experts.gate_up_proj"] = (e, h, 2 * i)
        shapes[f"{f}.experts.down_proj"] = (e, i, h)
        shapes |= _mlp(f"{f}.shared_expert", h, i)
    vh = c["vision_config"]["hidden_size"]
    shapes["vision_model.patch_embedding.linear.weight"] = (vh, 3 * 14 * 14)
    shapes["multi_modal_projector.linear_1.weight"] = (h, vh)
    return shapes


def ernie4_5_moe_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """ERNIE 4.5 MoE: dense layers before `moe_layer_start_index`, shared experts,
    a routing bias and an MTP head that mlx-lm drops."""
    h, e, i = c["hidden_size"], c["moe_num_experts"], c["moe_intermediate_size"]
    shapes = _lm(c)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= _norms(p, h) | _attention(p, c)
        if layer < c["moe_layer_start_index"]:
            shapes |= _mlp(f"{p}.mlp", h, c["intermediate_size"])
            continue
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        shapes[f"{p}.mlp.moe_statics.e_score_correction_bias"] = (1, e)
        shapes |= _experts(f"{p}.mlp", e, h, i)
        shapes |= _mlp(f"{p}.mlp.shared_experts", h, i * c["moe_num_shared_experts"])
    shapes["model.mtp_emb_norm.0.weight"] = (h,)
    shapes["model.mtp_hidden_norm.0.weight"] = (h,)
    shapes["model.mtp_linear_proj.0.weight"] = (h, 2 * h)
    return shapes


def bailing_moe_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """Ling (Bailing MoE): `word_embeddings`, fused `attention.query_key_value`,
    router `mlp.gate` with an expert bias, shared experts; with `norm_head`,
    mlx-lm normalizes lm_head in its sanitize."""
    h, e, nh = c["hidden_size"], c["num_experts"], c["num_attention_heads"]
    hd, i = h // nh, c["moe_intermediate_size"]
    qkv = (nh + 2 * c["num_key_value_heads"]) * hd
    shapes = _lm(c)
    shapes["model.word_embeddings.weight"] = shapes.pop("model.embed_tokens.weight")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        a = f"{p}.attention"
        shapes |= _norms(p, h)
        shapes[f"{a}.query_key_value.weight"] = (qkv, h)
        shapes[f"{a}.dense.weight"] = (h, nh * hd)
        shapes[f"{a}.query_layernorm.weight"] = (hd,)
        shapes[f"{a}.key_layernorm.weight"] = (hd,)
        if layer < c["first_k_dense_replace"]:
            shapes |= _mlp(f"{p}.mlp", h, c["intermediate_size"])
            continue
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        shapes[f"{p}.mlp.gate.expert_bias"] = (e,)
        shapes |= _experts(f"{p}.mlp", e, h, i)
        shapes |= _mlp(f"{p}.mlp.shared_experts", h, i * c["num_shared_experts"])
    return shapes


def granitemoe_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """Granite 3 MoE: each layer's experts in two 3-D tensors, `input_linear`
    [E, 2 x inter, hidden] (gate first) and `output_linear` [E, hidden, inter]."""
    h, e, i = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    shapes = _lm(c)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        moe = f"{p}.block_sparse_moe"
        shapes |= _norms(p, h) | _attention(p, c)
        shapes[f"{moe}.router.layer.weight"] = (e, h)
        shapes[f"{moe}.input_linear.weight"] = (e, 2 * i, h)
        shapes[f"{moe}.output_linear.weight"] = (e, h, i)
    return shapes


def gpt_oss_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """The float tensors of GPT-OSS; the MXFP4 experts come from `mxfp4_experts`."""
    h, e, nh = c["hidden_size"], c["num_local_experts"], c["num_attention_heads"]
    shapes = _lm(c)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= _norms(p, h) | _attention(p, c, bias=True, o_bias=True)
        shapes[f"{p}.self_attn.sinks"] = (nh,)
        shapes[f"{p}.mlp.router.weight"] = (e, h)
        shapes[f"{p}.mlp.router.bias"] = (e,)
        shapes[f"{p}.mlp.experts.gate_up_proj_bias"] = (e, 2 * c["intermediate_size"])
        shapes[f"{p}.mlp.experts.down_proj_bias"] = (e, h)
    return shapes


def mxfp4_experts(c: dict, seed: int) -> dict[str, mx.array]:
    """GPT-OSS experts as the hub ships them: MXFP4 `*_blocks` (two FP4 codes per
    byte, 32 per block) and `*_scales` (one power-of-two exponent per block)."""
    h, e, i = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    out = {}
    key = mx.random.key(seed + 1)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            key, kb, ks = mx.random.split(key, 3)
            blocks = mx.random.randint(0, 256, (e, rows, cols // 32, 16), key=kb)
            # 2^-5 .. 2^-2: with FP4 codes up to 6 some gates pass the clamp at 7
            scales = mx.random.randint(122, 126, (e, rows, cols // 32), key=ks)
            out[f"{p}.{name}_blocks"] = blocks.astype(mx.uint8)
            out[f"{p}.{name}_scales"] = scales.astype(mx.uint8)
    mx.eval(out)
    return out


def _linear_attention(p: str, c: dict, fused: bool) -> dict[str, tuple[int, ...]]:
    h, nk, nv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    a = f"{p}.linear_attn"
    shapes = {
        f"{a}.conv1d.weight": (2 * kd + vd, 1, c["linear_conv_kernel_dim"]),
        f"{a}.dt_bias": (nv,),
        f"{a}.A_log": (nv,),
        f"{a}.norm.weight": (c["linear_value_head_dim"],),
        f"{a}.out_proj.weight": (h, vd),
    }
    if fused:  # Qwen3-Next
        shapes[f"{a}.in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
        shapes[f"{a}.in_proj_ba.weight"] = (2 * nv, h)
    else:  # Qwen3.5
        shapes[f"{a}.in_proj_qkv.weight"] = (2 * kd + vd, h)
        shapes[f"{a}.in_proj_z.weight"] = (vd, h)
        shapes[f"{a}.in_proj_b.weight"] = (nv, h)
        shapes[f"{a}.in_proj_a.weight"] = (nv, h)
    return shapes


def _hybrid_layers(c: dict, prefix: str, fused: bool) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next / Qwen3.5 decoder layers: linear attention except every
    `full_attention_interval`-th layer, MoE with a sigmoid-gated shared expert."""
    h, e, i = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    shapes = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"{prefix}.layers.{layer}"
        shapes |= _norms(p, h)
        if (layer + 1) % c["full_attention_interval"]:
            shapes |= _linear_attention(p, c, fused)
        else:
            shapes |= _attention(p, c, q_factor=2)
            shapes[f"{p}.self_attn.q_norm.weight"] = (c["head_dim"],)
            shapes[f"{p}.self_attn.k_norm.weight"] = (c["head_dim"],)
        if layer in c.get("mlp_only_layers", []):
            shapes |= _mlp(f"{p}.mlp", h, c["intermediate_size"])
            continue
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        if fused:
            shapes |= _experts(f"{p}.mlp", e, h, i)
        else:  # Qwen3.5 ships every layer's experts as two 3-D tensors
            shapes[f"{p}.mlp.experts.gate_up_proj"] = (e, 2 * i, h)
            shapes[f"{p}.mlp.experts.down_proj"] = (e, h, i)
        shapes |= _mlp(
            f"{p}.mlp.shared_expert", h, c["shared_expert_intermediate_size"]
        )
        shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    # multi-token prediction head: on the hub, dropped by mlx-lm
    shapes["mtp.fc.weight"] = (h, 2 * h)
    shapes["mtp.norm.weight"] = (h,)
    shapes["mtp.pre_fc_norm_embedding.weight"] = (h,)
    shapes["mtp.pre_fc_norm_hidden.weight"] = (h,)
    return shapes


def qwen3_next_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    return _lm(c) | _hybrid_layers(c, "model", fused=True)


def qwen3_5_moe_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """Qwen3.5 MoE, a vision-language checkpoint: the text model sits under
    `model.language_model.`, the vision tower (dropped by mlx-lm) under
    `model.visual.`."""
    t = {**c["text_config"], "tie_word_embeddings": c["tie_word_embeddings"]}
    shapes = _lm(t, "model.language_model")
    shapes |= _hybrid_layers(t, "model.language_model", fused=False)
    vh = c["vision_config"]["hidden_size"]
    shapes["model.visual.patch_embed.proj.weight"] = (vh, 3, 2, 16, 16)
    shapes["model.visual.blocks.0.attn.qkv.weight"] = (3 * vh, vh)
    shapes["model.visual.merger.linear_fc2.weight"] = (t["hidden_size"], vh)
    return shapes


HUB_LAYOUTS: dict[str, tuple[dict, Callable[[dict], dict[str, tuple[int, ...]]]]] = {
    "qwen3_moe": (QWEN3_MOE, mlx_lm_tensors),
    "qwen2_moe": (QWEN2_MOE, mlx_lm_tensors),
    "qwen3_next": (QWEN3_NEXT, qwen3_next_tensors),
    "qwen3_5_moe": (QWEN3_5_MOE, qwen3_5_moe_tensors),
    "mixtral": (MIXTRAL, MIXTRAL_EXPERTS),
    "olmoe": (OLMOE, mlx_lm_tensors),
    "deepseek": (DEEPSEEK, mlx_lm_tensors),
    "deepseek_v2": (DEEPSEEK_V2, deepseek_tensors),
    "deepseek_v3": (DEEPSEEK_V3, deepseek_tensors),
    "kimi_k2": (KIMI_K2, deepseek_tensors),
    "glm4_moe": (GLM4_MOE, glm4_moe_tensors),
    "glm4_moe_lite": (GLM4_MOE_LITE, partial(deepseek_tensors, mtp=True)),
    "dots1": (DOTS1, mlx_lm_tensors),
    "minimax_m2": (MINIMAX_M2, MIXTRAL_EXPERTS),
    "phimoe": (PHIMOE, MIXTRAL_EXPERTS),
    "bailing_moe": (BAILING_MOE, bailing_moe_tensors),
    "granitemoe": (GRANITEMOE, granitemoe_tensors),
    "ernie4_5_moe": (ERNIE4_5_MOE, ernie4_5_moe_tensors),
    "hunyuan": (HUNYUAN, mlx_lm_tensors),
    "llama4": (LLAMA4, llama4_tensors),
    "gpt_oss": (GPT_OSS, gpt_oss_tensors),
}
# Kept in float32 on the hub whatever the checkpoint's dtype.
FLOAT32_TENSORS = ("e_score_correction_bias", "expert_bias")
# Small, as trained ones are, so the tokens still decide the routing.
SCORE_CORRECTION_SCALE = 0.05


def tiny_model(
    path: Path,
    model_type: str,
    dtype: mx.Dtype = mx.bfloat16,
    seed: int = 0,
    shards: int = 2,
    **overrides: object,
) -> Path:
    """A tiny random checkpoint of `model_type` in its hub layout."""
    base, tensors = HUB_LAYOUTS[model_type]
    config = {**base, **overrides}
    weights = random_weights(tensors(config), dtype, seed)
    for name in weights:
        if name.endswith(FLOAT32_TENSORS):
            weights[name] = SCORE_CORRECTION_SCALE * weights[name].astype(mx.float32)
    if model_type == "gpt_oss":
        weights |= mxfp4_experts(config, seed)
    return write_hf_model(path, config, weights, shards)
