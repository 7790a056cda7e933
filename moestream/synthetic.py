"""Random MoE checkpoints in real Hugging Face hub layout, for tests and benchmarks.

Tensor names, shapes and config keys are those of the hub's Qwen3-MoE
checkpoints (one 2-D tensor per expert), so the converter sees what a user's
download would give it. Large ones are written one layer per shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n"
    "        self.items.append(x)\n\nimport os\nprint('hello world')\n"
) * 20

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


def qwen3_moe_tensors(config: dict, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Hub tensor names and shapes of a Qwen3-MoE checkpoint (one tensor per expert)."""
    h, v = config["hidden_size"], config["vocab_size"]
    hd, nh, nkv = (
        config["head_dim"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (nh * hd, h),
                f"{p}.self_attn.k_proj.weight": (nkv * hd, h),
                f"{p}.self_attn.v_proj.weight": (nkv * hd, h),
                f"{p}.self_attn.o_proj.weight": (h, nh * hd),
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
            }
        )
        if layer in config["mlp_only_layers"]:
            i = config["intermediate_size"]
            shapes.update(
                {
                    f"{p}.mlp.gate_proj.weight": (i, h),
                    f"{p}.mlp.up_proj.weight": (i, h),
                    f"{p}.mlp.down_proj.weight": (h, i),
                }
            )
            continue
        i, e = config["moe_intermediate_size"], config["num_experts"]
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        for x in range(e):
            shapes[f"{p}.mlp.experts.{x}.gate_proj.weight"] = (i, h)
            shapes[f"{p}.mlp.experts.{x}.up_proj.weight"] = (i, h)
            shapes[f"{p}.mlp.experts.{x}.down_proj.weight"] = (h, i)
    return shapes


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


def write_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
        "assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
            }
        )
    )


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
    weights = random_weights(qwen3_moe_tensors(config), dtype, seed)
    return write_hf_model(path, config, weights, shards)


def large_qwen3_moe(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A bigger checkpoint written one decoder layer per shard (bounded memory)."""
    config = {**QWEN3_MOE, "mlp_only_layers": [], **overrides}
    shapes = qwen3_moe_tensors(config)
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
