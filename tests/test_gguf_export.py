"""GGUF export for llama.cpp: the names, shapes and types it loads, and the values."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moestream.bench.gguf_export import bf16_to_f32, q4_1_blocks, write_gguf
from moestream.bench.models import Scale, write_synthetic
from moestream.formats import BlobReader, load_manifest
from moestream.formats.manifest import inside

gguf = pytest.importorskip("gguf")

TINY = Scale(2, 4, 2, 128, 64, heads=2, kv_heads=1, head_dim=64, vocab=512)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny"
    write_synthetic(out, TINY)
    return out


def _expert_values(model: Path, layer: int, proj: str) -> np.ndarray:
    """MLX's dequantization of every expert of one projection, (E, out, in), in
    float32: the codes, scales and biases, not bfloat16's rounding of s*q + b."""
    entry = load_manifest(model).layers[layer]
    with BlobReader(inside(model, entry.file), entry) as blob:
        parts = {}
        for seg in entry.segments:
            if seg.projection == proj:
                rows = [
                    blob.segment(blob.record(e), seg) for e in range(entry.num_experts)
                ]
                parts[seg.name.rpartition(".")[2]] = np.stack(rows)
    w = mx.array(parts["weight"])
    s = mx.array(parts["scales"]).view(mx.bfloat16).astype(mx.float32)
    b = mx.array(parts["biases"]).view(mx.bfloat16).astype(mx.float32)
    return np.array(mx.dequantize(w, s, b, group_size=64, bits=4).astype(mx.float32))


def test_q4_1_gguf_holds_the_same_values_under_llama_cpp_names(synthetic, tmp_path):
    out = tmp_path / "m.gguf"
    stats = write_gguf(synthetic, out, "q4_1")
    assert stats["expert_bits_per_weight"] == pytest.approx(5.0)
    reader = gguf.GGUFReader(str(out))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3moe"
    tensors = {t.name: t for t in reader.tensors}
    T = gguf.GGMLQuantizationType
    for i in range(TINY.layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            assert tensors[f"blk.{i}.{name}.weight"].tensor_type == T.Q4_1
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"].tensor_type == T.F32
        assert tensors[f"blk.{i}.attn_q_norm.weight"].tensor_type == T.F32
        gate = tensors[f"blk.{i}.ffn_gate_exps.weight"]
        # ggml order: (in, out, experts)
        assert list(gate.shape) == [TINY.hidden, TINY.moe_intermediate, TINY.experts]
        down = tensors[f"blk.{i}.ffn_down_exps.weight"]
        assert list(down.shape) == [TINY.moe_intermediate, TINY.hidden, TINY.experts]
        for proj, t in (("gate_proj", gate), ("down_proj", down)):
            got = gguf.dequantize(t.data, t.tensor_type)
            assert np.array_equal(got, _expert_values(synthetic, i, proj))
    assert {"token_embd.weight", "output.weight", "output_norm.weight"} <= set(tensors)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == TINY.vocab


def test_q4_0_gguf_has_the_bits_of_mlx_and_close_values(synthetic, tmp_path):
    out = tmp_path / "m0.gguf"
    stats = write_gguf(synthetic, out, "q4_0")
    assert stats["expert_bits_per_weight"] == pytest.approx(4.5)
    t = next(
        t
        for t in gguf.GGUFReader(str(out)).tensors
        if t.name == "blk.1.ffn_up_exps.weight"
    )
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
    want = _expert_values(synthetic, 1, "up_proj")
    got = gguf.dequantize(t.data, t.tensor_type)
    # another 4-bit grid: within a quantization step of MLX's values, not equal
    step = np.abs(want).max() / 7
    assert np.abs(got - want).max() <= step and not np.array_equal(got, want)


def test_q4_1_blocks_pack_low_nibbles_first_and_split_groups():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (3, 128), dtype=np.uint32)
    words = (codes.reshape(3, 16, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(-1)
    words = words.astype(np.uint32)
    scales = (np.float32([[0.5, 0.25]] * 3).view(np.uint32) >> 16).astype(np.uint16)
    biases = (np.float32([[-1.0, 2.0]] * 3).view(np.uint32) >> 16).astype(np.uint16)
    blocks = q4_1_blocks(words, scales, biases)
    got = gguf.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    want = codes * np.repeat(bf16_to_f32(scales), 64, -1) + np.repeat(
        bf16_to_f32(biases), 64, -1
    )
    assert got.shape == (3, 128) and np.array_equal(got, want)


def test_llama_rows_one_set_per_n_cpu_moe(tmp_path: Path) -> None:
    """`compare --n-cpu-moe 18 --cpu-moe`: a set of llama.cpp rows for each
    -ncmoe value, each labelled with it; the value reaches llama-bench's argv."""
    from moestream.bench.llama_cpp import LlamaJob

    assert LlamaJob("x", "m", ngl=99, n_cpu_moe=18).argv()[-4:] == [
        "-ngl",
        "99",
        "-ncmoe",
        "18",
    ]
    from moestream.bench.peer import PeerConfig, llama_rows

    cfg = PeerConfig(
        out=tmp_path,
        ggufs=(("q4_0", tmp_path / "m.gguf"),),
        exe=tmp_path / "llama-bench",
        modes=("warm", "cold"),
        ngl=99,
        n_cpu_moe=(18, 24),
    )
    rows = llama_rows(cfg)
    assert [(r.slots, r.mode) for r in rows] == [
        ("-ngl 99 -ncmoe 18", "warm"),
        ("-ngl 99 -ncmoe 18", "cold"),
        ("-ngl 99 -ncmoe 24", "warm"),
        ("-ngl 99 -ncmoe 24", "cold"),
    ]


def test_compare_rows_for_other_runtime_fields(synthetic) -> None:
    """`compare --compare backend=mapped`: a moestream row of those fields
    beside each budget's, labelled with them, its job carrying them."""
    from moestream.bench.peer import PeerConfig, moestream_rows

    cfg = PeerConfig(
        out=synthetic,
        ggufs=(),
        exe=synthetic / "llama-bench",
        budgets=(100,),
        resident=False,
        compare=(("backend=mapped", {"backend": "mapped"}),),
    )
    rows = moestream_rows(cfg)
    assert [r.slots for r in rows] == ["4 (100 %)", "4 (100 %) backend=mapped"]
    jobs = [r.decode_run.__defaults__[0] for r in rows]
    assert [j.runtime.backend for j in jobs] == ["auto", "mapped"]


def test_a_failing_llama_bench_says_why_and_what_to_do(tmp_path: Path) -> None:
    from moestream.bench.llama_cpp import LlamaJob, ToolError, run_llama_bench

    exe = tmp_path / "llama-bench"
    exe.write_text(
        "#!/bin/sh\n"
        "echo 'alloc_tensor_range: failed to allocate CPU_REPACK buffer' >&2\n"
        "echo 'llama_bench: error: failed to load model' >&2\n"
        "exit 1\n"
    )
    exe.chmod(0o755)
    job = LlamaJob(str(exe), str(tmp_path / "m.gguf"), decode_tokens=4)
    with pytest.raises(ToolError) as e:
        run_llama_bench(job)
    message = str(e.value)
    assert message.startswith("llama-bench failed (1): llama_bench: error: failed")
    assert "--llama-arg=--repack --llama-arg=0" in message
    assert message.endswith(" ".join(job.argv()))


def test_compare_reads_each_peer_row_as_llama_bench_and_prefills_every_repeat():
    """ik_llama.cpp's rows are read with llama-bench's keys as llama.cpp's
    are; every repeat runs each row's prefill beside its decode; the table's
    "x llama.cpp" columns divide by the first llama.cpp row."""
    from moestream.bench.peer import PeerRow, format_table, run_rows, summarize

    def bench(tps: float) -> dict:
        return {
            "tps": tps,
            "seconds": 1.0,
            "peak_rss": 2**20,
            "disk_bytes_per_token": 0,
        }

    def ours(tps: float) -> dict:
        return {
            "decode_tps": tps,
            "prefill_tps": 2 * tps,
            "prefill_s": 1.0,
            "peak_rss": 2**20,
            "disk_bytes_per_token": 0,
            "bytes_per_token": 0,
            "tokens": [1, 2],
        }

    rows = [
        PeerRow(
            "moestream", "8 (100 %)", "warm", lambda: ours(10.0), lambda: ours(10.0)
        ),
        PeerRow(
            "llama.cpp q4_0",
            "mmap",
            "warm",
            lambda: bench(20.0),
            lambda: bench(40.0),
            peer=True,
        ),
        PeerRow(
            "ik_llama.cpp q4_0",
            "mmap",
            "warm",
            lambda: bench(30.0),
            lambda: bench(80.0),
            peer=True,
        ),
    ]
    said = []
    run_rows(rows, 3, said.append)
    assert len(said) == 9
    out = [summarize(r, None) for r in rows]
    assert [r["decode_tps"] for r in out] == [10.0, 20.0, 30.0]
    assert [r["prefill_tps"] for r in out] == [20.0, 40.0, 80.0]
    assert [len(r["prefill_spread"]) for r in out] == [3, 3, 3]
    table = format_table({"rows": out})
    assert "| moestream | 8 (100 %) | warm | 10.00 |  | 0.50 | 20.0 | 0.50 |" in table
    assert (
        "| ik_llama.cpp q4_0 | mmap | warm | 30.00 |  | 1.50 | 80.0 | 2.00 |" in table
    )
