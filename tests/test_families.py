"""Every family mlx-lm runs: hub layout in, logits bit-identical to mlx-lm out.

Each case is a tiny random checkpoint with the hub's tensor names and config
keys (tests/builders/synthetic.py), converted with mixed bits where the family allows,
and compared with mlx-lm's fully resident model in prefill and decode at a
cache below top-k (every call runs in groups) and a mid-sized one.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from builders.synthetic import HUB_LAYOUTS, tiny_model, write_hf_model
from builders.synthetic_sources import read_hf
from helpers import BITS, PROMPT, logits_stepwise, same_files
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

import moestream
from moestream.converter import SourceError, convert
from moestream.families import (
    FAMILIES,
    layer_index,
    mlx_lm_classes,
    module_at,
    replace_module,
    switch_modules,
)
from moestream.formats import BlobReader, Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import native
from moestream.runtime.loader import router_predictor

# below top-k (2): every call runs in groups; mid: 5 of 8 experts resident
CACHE_SIZES = [1, 5]
ENGINES = ["python"] + (["native"] * native.available())
DECODE_STEPS = 6
# The oracle's compute dtype, named so the tests mean the same on a GPU ("auto"
# would be the stored bfloat16 there).
F32 = "float32"


FAMILY_NAMES = sorted(set(HUB_LAYOUTS) - {"qwen3_moe"})


@dataclass
class Case:
    family: str
    src: Path
    out: Path
    reference: object
    logits: list[mx.array]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def case(request, tmp_path_factory) -> Case:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = tiny_model(root / "hf", family, seed=3)
    bits = _bits(family)
    convert(str(src), root / "out", bits=bits, progress=False)
    ref = resident_model(src, Recipe.parse(bits))
    return Case(
        family, src, root / "out", ref, logits_stepwise(ref, PROMPT, DECODE_STEPS)
    )


def _bits(case: Case | str) -> str | None:
    family = case if isinstance(case, str) else case.family
    return None if family == "gpt_oss" else BITS  # MXFP4 experts are kept as shipped


def test_every_family_is_registered_and_built():
    assert set(FAMILIES) == set(HUB_LAYOUTS)


def test_mlx_lm_private_get_classes_is_as_expected():
    """families.mlx_lm_classes wraps mlx-lm's private `_get_classes`: if mlx-lm
    renames it or changes what it takes or returns, this fails first."""
    import inspect

    import mlx_lm.utils

    get_classes = getattr(mlx_lm.utils, "_get_classes", None)
    assert get_classes is not None, "mlx_lm.utils._get_classes is gone"
    assert list(inspect.signature(get_classes).parameters) == ["config"]
    for family, (config, _) in HUB_LAYOUTS.items():
        model_class, args_class = mlx_lm_classes(config)
        assert issubclass(model_class, nn.Module), family
        assert model_class.__module__.startswith("mlx_lm.models."), family
        assert callable(args_class.from_dict), family


def logits_bit_identical(case: Case, cache_experts: int, engine: str) -> None:
    model, _ = moestream.load(
        case.out, cache_experts=cache_experts, dtype=F32, engine=engine
    )
    ours = logits_stepwise(model, PROMPT, DECODE_STEPS)
    for step, (a, b) in enumerate(zip(ours, case.logits, strict=True)):
        assert mx.array_equal(a, b).item(), (
            f"{case.family} ({engine}, {cache_experts} slots): step {step} differs"
        )
    s = moestream.stats(model)
    assert s.misses > 0 and s.evictions > 0
    if cache_experts == 1:
        assert s.grouped_calls > 0


def test_logits_bit_identical_both_engines_both_caches(case: Case):
    """Each family through both engines and both cache sizes, paired crosswise
    and the pairing alternating over the families (every engine at every cache
    size on half of them); every pairing on every family: the slow test below."""
    small, mid = CACHE_SIZES
    if FAMILY_NAMES.index(case.family) % 2:
        small, mid = mid, small
    for cache_experts, engine in zip(
        (small, mid), ["python", ENGINES[-1]], strict=True
    ):
        logits_bit_identical(case, cache_experts, engine)


@pytest.mark.slow  # the same on every pairing: make test-all
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cache_experts", CACHE_SIZES)
def test_logits_bit_identical(case: Case, cache_experts: int, engine: str):
    logits_bit_identical(case, cache_experts, engine)


@pytest.mark.slow  # MLX's CPU kernels run bfloat16 slowly: ~20 s for all families
def test_bfloat16_compute_bit_identical(case: Case):
    """The stored dtype, as on a GPU: biases, scales and norms stay exact too."""
    model, _ = moestream.load(case.out, cache_experts=2, dtype="bfloat16")
    ref = resident_model(case.src, Recipe.parse(_bits(case)), compute_dtype="bfloat16")
    ours, theirs = logits_stepwise(model, PROMPT, 3), logits_stepwise(ref, PROMPT, 3)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == mx.bfloat16
        assert mx.array_equal(a, b).item(), f"{case.family}: step {step} differs"


def test_segments_carry_the_recipe(case: Case):
    """Mixed bits per projection and layer; gpt_oss experts stay MXFP4."""
    recipe = Recipe.parse(BITS)
    for layer in load_manifest(case.out).layers:
        for seg in layer.segments:
            proj, _, kind = seg.name.rpartition(".")
            if kind not in ("weight", "scales", "biases"):
                assert case.family == "gpt_oss" and kind == "bias"
            elif case.family == "gpt_oss":
                assert (seg.mode, seg.bits, seg.group_size) == ("mxfp4", 4, 32)
            else:
                spec = recipe.expert_spec(proj, layer.layer)
                assert (seg.mode, seg.bits) == ("affine", spec.bits), seg.name


def test_memory_budget_load(case: Case):
    """The budget planner reads each family's config (text_config included)."""
    model, _ = moestream.load(case.out, memory_budget="4G", dtype=F32)
    plan = moestream.runtime_of(model).plan
    assert plan.capacity == 8 and plan.total <= plan.budget
    prefill = logits_stepwise(model, PROMPT, 0)[0]
    assert mx.array_equal(prefill, case.logits[0]).item()


class _Recorder(nn.Module):
    """A SwitchGLU that notes what its block gave it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._inner, self._calls = inner, []

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self._calls.append((x, indices))
        return self._inner(x, indices)


def test_prefetch_router_matches_the_blocks_choice(case: Case):
    """The router prefetch finds in each block picks the experts the block picks."""
    ref = case.reference  # its SwitchGLUs recorded for one call, then put back
    recorders = {}
    originals = switch_modules(ref)
    try:
        for path, module in originals.items():
            recorders[path] = _Recorder(module)
            replace_module(ref, path, recorders[path])
        mx.eval(ref(PROMPT))
    finally:
        for path, module in originals.items():
            replace_module(ref, path, module)
    restored = switch_modules(ref)
    assert all(restored[p] is m for p, m in originals.items())
    config = json.loads((case.src / "config.json").read_text())
    top_k = FAMILIES[case.family].top_k(config)
    for path, rec in recorders.items():
        block = module_at(ref, path.rpartition(".")[0])
        (x, inds), *_ = rec._calls
        ours = router_predictor(block, top_k)(x)
        assert np.array_equal(np.sort(ours, -1), np.sort(inds, -1)), path
    # and the streaming model chains it with the family's top-k (the native
    # engine's read-ahead, when asked for; the python engine does not prefetch)
    if not native.available():
        return
    model, _ = moestream.load(
        case.out,
        cache_experts=2,
        dtype=F32,
        prefetch=True,
        prefetch_extra=0,
        engine="native",
    )
    path = min(recorders, key=layer_index)
    x, _ = recorders[path]._calls[0]
    assert module_at(model, path)._engine.predict(x).shape[-1] == top_k


def test_distinctive_parts(case: Case):
    """What sets the family apart is present and really used."""
    manifest = load_manifest(case.out)
    for check in CHECKS[case.family]:
        check(case, manifest)


def _config(case: Case) -> dict:
    config = json.loads((case.src / "config.json").read_text())
    return config.get("text_config", config)


def _source_names(case: Case) -> list[str]:
    index = json.loads((case.src / "model.safetensors.index.json").read_text())
    return list(index["weight_map"])


def _nonzero(model, path: str) -> None:
    params = tree_flatten(module_at(model, path).parameters())
    assert params, f"{path} has no parameters"
    for name, p in params:
        if mx.issubdtype(p.dtype, mx.floating):
            assert mx.any(p != 0).item(), f"{path}.{name} is all zeros"


def _all_routed(case: Case, manifest) -> None:
    """Every decoder layer has routed experts."""
    moe = [layer.layer for layer in manifest.layers]
    assert moe == list(range(_config(case)["num_hidden_layers"]))


def _dense_first(case: Case, manifest) -> None:
    """The first layers are dense: MoE layer numbers do not start at 0."""
    c = _config(case)
    first = c.get("first_k_dense_replace", c.get("moe_layer_start_index"))
    moe = [layer.layer for layer in manifest.layers]
    assert moe == list(range(first, c["num_hidden_layers"]))
    assert moe[0] > 0


def _shared(name: str):
    def check(case: Case, manifest) -> None:
        """A shared expert beside the routed ones, nonzero and used."""
        for layer in manifest.layers:
            _nonzero(case.reference, f"{layer.module.rpartition('.')[0]}.{name}")
        _changes_logits(case, lambda m: _zero_modules(m, f".{name}"))

    return check


def _group_routing(case: Case, manifest) -> None:
    """Group-limited routing changes which experts run."""
    c = _config(case)
    assert c["n_group"] > 1 and c["topk_group"] < c["n_group"]
    _changes_logits(case, _ungroup)


def _score_correction(case: Case, manifest) -> None:
    """The router's score-correction bias reaches the model and matters."""
    model, _ = moestream.load(case.out, cache_experts=2, dtype=F32)
    biases = [
        v for k, v in tree_flatten(model.parameters()) if k.endswith(ROUTING_BIASES)
    ]
    assert len(biases) == len(manifest.layers)
    assert all(mx.any(b != 0).item() for b in biases)
    _changes_logits(case, _zero_score_correction)


# Router biases that steer top-k choice only (DeepSeek-V3 style; bailing's name).
ROUTING_BIASES = ("e_score_correction_bias", "expert_bias")


def _mtp_dropped(case: Case, manifest) -> None:
    """The hub's multi-token-prediction layer (after the last) is dropped."""
    n = _config(case)["num_hidden_layers"]
    assert any(k.startswith(f"model.layers.{n}.") for k in _source_names(case))
    assert max(layer.layer for layer in manifest.layers) == n - 1


def _hybrid(case: Case, manifest) -> None:
    """Linear-attention layers with their own caches beside full attention; the
    hub's multi-token-prediction head (and vision tower) dropped."""
    names = _source_names(case)
    assert any(n.startswith("mtp.") for n in names)
    caches = make_prompt_cache(case.reference)
    assert [isinstance(c, ArraysCache) for c in caches] == [True, True, True, False]
    moe = [layer.layer for layer in manifest.layers]
    if case.family == "qwen3_next":
        assert moe == [1, 2, 3]  # mlp_only_layers: [0]
    else:  # the text model of a vision-language checkpoint
        module = manifest.layers[0].module
        assert module == "language_model.model.layers.0.mlp.switch_mlp"
        assert moe == [0, 1, 2, 3]
        assert any(n.startswith("model.visual.") for n in names)


def _vision_dropped(case: Case, manifest) -> None:
    """A vision-language checkpoint: its vision tower is dropped, the text model's
    experts stream."""
    assert any(n.startswith("vision_model.") for n in _source_names(case))
    assert manifest.layers[0].module.startswith("language_model.model.layers.0.")


def _mxfp4_kept(case: Case, manifest) -> None:
    """The blob holds the hub's MXFP4 bytes, de-interleaved as mlx-lm does,
    and the slots compute in mode mxfp4."""
    layer = manifest.layers[1]
    src = {}
    for f in case.src.glob("*.safetensors"):
        src |= mx.load(str(f))
    prefix = f"model.layers.{layer.layer}.mlp.experts"
    blocks = np.array(src[f"{prefix}.gate_up_proj_blocks"])
    scales = np.array(src[f"{prefix}.gate_up_proj_scales"])
    with BlobReader(case.out / layer.file, layer) as blob:
        for e in (0, layer.num_experts - 1):
            record = blob.record(e)
            up = blob.segment(record, layer.segment("up_proj.weight"))
            assert up.tobytes() == blocks[e, 1::2].tobytes()
            gate_scales = blob.segment(record, layer.segment("gate_proj.scales"))
            assert np.array_equal(gate_scales, scales[e, ::2])
    model, _ = moestream.load(case.out, cache_experts=2, dtype=F32)
    inner = model.model.layers[0].mlp.experts._inner
    assert inner.down_proj.mode == "mxfp4" and inner.down_proj.scales.dtype == mx.uint8


def _expert_biases(case: Case, manifest) -> None:
    names = {s.name for s in manifest.layers[0].segments}
    assert {"gate_proj.bias", "up_proj.bias", "down_proj.bias"} <= names
    for layer in manifest.layers:
        _nonzero(case.reference, layer.module)  # its only float tensors: biases


def _clamped_swiglu(case: Case, manifest) -> None:
    """GPT-OSS's SwiGLU clamps at 7, and the test input reaches the clamp."""
    _changes_logits(case, _unclamp)


CHECKS = {
    "mixtral": [_all_routed],
    "olmoe": [_all_routed],
    "qwen2_moe": [_all_routed, _shared("shared_expert")],
    "qwen3_next": [_hybrid, _shared("shared_expert")],
    "qwen3_5_moe": [_hybrid, _shared("shared_expert")],
    "deepseek": [_dense_first, _shared("shared_experts")],
    "deepseek_v2": [_dense_first, _shared("shared_experts"), _group_routing],
    "deepseek_v3": [
        _dense_first,
        _shared("shared_experts"),
        _group_routing,
        _score_correction,
    ],
    "glm4_moe": [
        _dense_first,
        _shared("shared_experts"),
        _score_correction,
        _mtp_dropped,
    ],
    "kimi_k2": [_dense_first, _shared("shared_experts"), _score_correction],
    "glm4_moe_lite": [
        _dense_first,
        _shared("shared_experts"),
        _score_correction,
        _mtp_dropped,
    ],
    "dots1": [_dense_first, _shared("shared_experts"), _score_correction],
    "minimax_m2": [_all_routed, _score_correction],
    "phimoe": [_all_routed],
    "ernie4_5_moe": [_dense_first, _shared("shared_experts")],
    "hunyuan": [_all_routed, _shared("shared_mlp")],
    "llama4": [_all_routed, _shared("shared_expert"), _vision_dropped],
    "bailing_moe": [
        _dense_first,
        _shared("shared_experts"),
        _group_routing,
        _score_correction,
    ],
    "granitemoe": [_all_routed],
    "gpt_oss": [_mxfp4_kept, _expert_biases, _clamped_swiglu],
}


def _zero_modules(model, suffix: str) -> None:
    for path, module in model.named_modules():
        if path.endswith(suffix):
            module.update(tree_map(mx.zeros_like, module.parameters()))


def _unclamp(model) -> None:
    for m in switch_modules(model).values():
        m.activation._limit = float("inf")


def _ungroup(model) -> None:
    """Route over all experts instead of the best groups only."""
    for _, module in model.named_modules():
        if hasattr(module, "n_group"):
            module.n_group = 1
            if hasattr(module, "topk_method"):  # deepseek_v2
                module.topk_method = "greedy"


def _zero_score_correction(model) -> None:
    for _, module in model.named_modules():
        for name in ROUTING_BIASES:
            if name in module:
                module[name] = mx.zeros_like(module[name])


def _changes_logits(case: Case, alter) -> None:
    """Altering the reference with `alter` changes its logits: the test input
    really goes through that part."""
    ref = resident_model(case.src, Recipe.parse(_bits(case)))
    alter(ref)
    assert not mx.array_equal(ref(PROMPT), case.logits[0]).item()


def test_fused_experts_convert_byte_identical(case: Case, tmp_path):
    """Experts saved fused ([E, 2I, H] gate_up_proj + [E, H, I] down_proj, as
    transformers >= 5 saves them) convert to the same bytes as per-expert ones."""
    from moestream.converter.layouts import EXPERT_NAMES

    if case.family not in EXPERT_NAMES:
        pytest.skip(f"{case.family}: mlx-lm's sanitize reads its own fused tensors")
    config, w = read_hf(case.src)
    per_expert = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    stacks: dict[str, dict[str, dict[int, mx.array]]] = {}
    for k in [k for k in w if per_expert.match(k)]:
        container, e, proj = per_expert.match(k).groups()
        stacks.setdefault(container, {}).setdefault(proj, {})[int(e)] = w.pop(k)
    for container, projs in stacks.items():
        gate, up, down = (
            mx.stack([projs[p][e] for e in sorted(projs[p])])
            for p in ("gate", "up", "down")
        )
        w[f"{container}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        w[f"{container}.down_proj"] = down
    src = write_hf_model(tmp_path / "fused", config, w, shards=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(case.src / f, src / f)
    summary = convert(str(src), tmp_path / "out", bits=_bits(case), progress=False)
    assert summary.source_layout == "fused expert tensors"
    same_files(case.out, tmp_path / "out")


def test_gpt_oss_refuses_bits_for_mxfp4_experts(tmp_path):
    src = tiny_model(tmp_path / "hf", "gpt_oss")
    with pytest.raises(SourceError, match=r"ship as MXFP4 .*kept.*drop --bits"):
        convert(str(src), tmp_path / "out", bits="down_proj=6", progress=False)
