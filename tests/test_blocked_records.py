"""Expert records stored blocked (format v2, convert-moe --layout blocked):
the layout on disk, the manifest's rules, the converter's output, and the
python engine's slots filled from them, bit-identical to mlx-lm's resident
model. The native engine does not read blocked records here (its side is
csrc/'s); on a GPU it refuses them in one line."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from builders.synthetic import tiny_model, tiny_qwen3_moe
from click.testing import CliRunner
from helpers import (
    BITS,
    BITS4,
    PROMPT,
    copy_of,
    edit_manifest,
    logits_stepwise,
    same_files,
)

import moestream
from moestream.cli import main as cli
from moestream.cli.convert import main as convert_main
from moestream.converter import ConvertError, convert
from moestream.formats import (
    BLOCK_ROWS,
    BlobReader,
    ExpertLayer,
    FormatError,
    Manifest,
    blocked,
    blocked_layout,
    layer_layout,
    load_manifest,
    pack_record,
    unblocked,
    write_blob,
)
from moestream.formats.manifest import layer_from_dict, layer_to_dict, validate_layer
from moestream.runtime import backend, native
from moestream.runtime.store import SlotFiller
from moestream.runtime.switch import StreamingSwitchGLU


@pytest.fixture(scope="module")
def blocked_out(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's `converted` model (same source, same bits), blocked."""
    out = tmp_path_factory.mktemp("blocked") / "model"
    convert(str(hf_dir), out, bits=BITS, progress=False, layout="blocked")
    return out


@pytest.fixture
def blocked_copy(blocked_out: Path, tmp_path: Path) -> Path:
    return copy_of(blocked_out, tmp_path)


# ------------------------------------------------------------------ layout


def test_blocked_layout_formula() -> None:
    """Element (r, c) at ((r // 16) * cols + c) * 16 + r % 16; unblocked undoes it."""
    assert BLOCK_ROWS == 16
    a = np.arange(2 * 48 * 5, dtype=np.uint32).reshape(2, 48, 5)
    b = blocked(a)
    assert b.shape == a.shape and b.dtype == a.dtype
    flat = b.reshape(2, -1)
    for r in range(48):
        for c in range(5):
            assert flat[1, (r // 16 * 5 + c) * 16 + r % 16] == a[1, r, c]
    assert np.array_equal(unblocked(b), a)
    assert not np.array_equal(b, a)


def _layer(tensors: list, num_experts: int = 3) -> ExpertLayer:
    return layer_layout(4, "model.layers.4.mlp.switch_mlp", num_experts, tensors)


Q = {"bits": 4, "group_size": 32, "mode": "affine"}
TENSORS = [
    ("a.weight", "uint32", (32, 4), Q),  # whole blocks: blocked
    ("a.scales", "bfloat16", (32, 1), None),
    ("a.bias", "float32", (32,), None),  # 1-D: stays rows
    ("b.weight", "uint32", (24, 4), Q),  # 24 rows: the projection stays rows
    ("b.scales", "bfloat16", (24, 1), None),
    ("c.weight", "float16", (16, 3), None),  # unquantized, whole blocks
]


def test_only_projections_with_whole_blocks_are_blocked() -> None:
    layer = blocked_layout(_layer(TENSORS))
    layouts = {s.name: s.layout for s in layer.segments}
    assert layouts == {
        "a.weight": "blocked",
        "a.scales": "blocked",
        "a.bias": "rows",
        "b.weight": "rows",
        "b.scales": "rows",
        "c.weight": "blocked",
    }
    assert layer.blocked and not _layer(TENSORS).blocked
    validate_layer(layer, "layer 4")
    again = layer_from_dict(json.loads(json.dumps(layer_to_dict(layer))))
    assert again == layer


def test_pack_record_blocks_and_segment_unblocks(tmp_path: Path) -> None:
    """On disk a blocked segment holds `blocked(tensor)`'s bytes; the reader
    gives back the tensor in rows, as MLX holds it."""
    layer = blocked_layout(_layer(TENSORS))
    rng = np.random.default_rng(0)
    words = {"uint32": np.uint32, "bfloat16": np.uint16}  # floats: their dtype
    experts = [
        {
            s.name: rng.integers(0, 2**16, s.shape).astype(words[s.dtype])
            if s.dtype in words
            else rng.standard_normal(s.shape).astype(s.dtype)
            for s in layer.segments
        }
        for _ in range(layer.num_experts)
    ]
    records = [pack_record(layer.segments, layer.record_nbytes, e) for e in experts]
    sums = write_blob(tmp_path / "x.blob", layer, records)
    layer = ExpertLayer(**{**layer.__dict__, "checksums": tuple(sums)})
    with BlobReader(tmp_path / "x.blob", layer) as r:
        for e, want in enumerate(experts):
            record = r.record(e)
            assert r.verify(e) and record == records[e]
            for s in layer.segments:
                stored = record[s.offset : s.offset + s.nbytes]
                ordered = blocked(want[s.name]) if s.blocked else want[s.name]
                assert stored == ordered.tobytes(), s.name
                assert np.array_equal(r.segment(record, s), want[s.name]), s.name


# ------------------------------------------------------------------ manifest


def _by_name(d: dict, layer: int, name: str) -> dict:
    return next(s for s in d["layers"][layer]["segments"] if s["name"] == name)


def _drop_layouts(d: dict) -> None:
    for layer in d["layers"]:
        for s in layer["segments"]:
            s.pop("layout", None)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=1), r"has a layout, which format version 1"),
        (
            lambda d: _by_name(d, 0, "up_proj.scales").update(layout="columns"),
            r"unknown layout 'columns'",
        ),
        (
            lambda d: _by_name(d, 0, "up_proj.scales").update(layout=16),
            r"Expected a string",
        ),
        (
            lambda d: _by_name(d, 0, "up_proj.scales").update(layout=None),
            r"Expected a string",
        ),
        (  # the same bytes as 1-D
            lambda d: _by_name(d, 0, "up_proj.scales").update(shape=[128]),
            r"is blocked but is not 2-D",
        ),
        (  # the same bytes in 8 rows
            lambda d: _by_name(d, 0, "up_proj.scales").update(shape=[8, 16]),
            r"is blocked but is not 2-D with rows a multiple of 16",
        ),
        (
            lambda d: _by_name(d, 0, "up_proj.scales").pop("layout"),
            r"projection up_proj mixes blocked and row-major",
        ),
        (_drop_layouts, r"Format version 2 without any blocked segment"),
    ],
)
def test_bad_blocked_manifest_refused(blocked_copy: Path, edit, message) -> None:
    edit_manifest(blocked_copy, edit)
    with pytest.raises(FormatError, match=message) as e:
        load_manifest(blocked_copy)
    assert "\n" not in str(e.value)


def test_v1_manifest_with_a_rows_layout_key_refused(copy: Path) -> None:
    """Format v1 has no layout field at all, not even "rows"."""
    edit_manifest(copy, lambda d: d["layers"][0]["segments"][0].update(layout="rows"))
    with pytest.raises(FormatError, match="which format version 1 does not have"):
        load_manifest(copy)


# ------------------------------------------------------------------ converter


def test_blocked_conversion_differs_only_in_layout(
    converted: Path, blocked_out: Path
) -> None:
    """The manifests are equal but for version, layout and expert checksums;
    every other file is the same bytes; every segment reads back the same."""
    rows, ours = load_manifest(converted), load_manifest(blocked_out)
    assert (rows.version, ours.version) == (1, 2)
    assert ours.blocked and not rows.blocked
    assert all(s.blocked for layer in ours.layers for s in layer.segments)
    assert '"layout"' not in (converted / "manifest.json").read_text()
    raw = json.loads((blocked_out / "manifest.json").read_text())
    assert all(
        s["layout"] == "blocked" for layer in raw["layers"] for s in layer["segments"]
    )

    def plain(m: Manifest) -> dict:
        d = json.loads(m.to_json())
        _drop_layouts(d)
        for layer in d["layers"]:
            layer.pop("checksums")
        return {k: v for k, v in d.items() if k != "version"}

    assert plain(rows) == plain(ours)
    assert rows.file_checksums == ours.file_checksums  # dense, config, tokenizer
    for a, b in zip(rows.layers, ours.layers, strict=True):
        assert a.checksums != b.checksums
        with (
            BlobReader(converted / a.file, a) as ra,
            BlobReader(blocked_out / b.file, b) as rb,
        ):
            for e in range(a.num_experts):
                ka, kb = ra.record(e), rb.record(e)
                assert ka != kb
                for sa, sb in zip(a.segments, b.segments, strict=True):
                    assert np.array_equal(ra.segment(ka, sa), rb.segment(kb, sb))


def test_blocked_conversion_is_deterministic(
    hf_dir: Path, blocked_out: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again"
    convert(str(hf_dir), again, bits=BITS, progress=False, layout="blocked")
    same_files(blocked_out, again)


def test_blocked_conversion_verifies(blocked_out: Path, blocked_copy: Path) -> None:
    report = moestream.verify(blocked_out)
    assert report.ok, report.problems
    layer = load_manifest(blocked_copy).layers[0]
    blob = blocked_copy / layer.file
    data = bytearray(blob.read_bytes())
    data[layer.data_offset + 3 * layer.stride + 100] ^= 1
    blob.write_bytes(bytes(data))
    assert any("expert 3" in p for p in moestream.verify(blocked_copy).problems)


def test_biases_of_a_family_stay_rows(tmp_path: Path) -> None:
    """gpt-oss: each projection's 1-D bias stays rows, its mxfp4 weight and
    scales are blocked; the python engine on them equals the rows conversion."""
    src = tiny_model(tmp_path / "hf", "gpt_oss")
    rows, ours = tmp_path / "rows", tmp_path / "blocked"
    convert(str(src), rows, progress=False)
    convert(str(src), ours, progress=False, layout="blocked")
    layer = load_manifest(ours).layers[0]
    for s in layer.segments:
        assert s.blocked == (len(s.shape) == 2), s.name
    assert moestream.verify(ours).ok
    a, _ = moestream.load(rows, cache_experts=3, engine="python")
    b, _ = moestream.load(ours, cache_experts=3, engine="python")
    prompt = PROMPT[:, :24]
    for x, y in zip(
        logits_stepwise(a, prompt, 3), logits_stepwise(b, prompt, 3), strict=True
    ):
        assert mx.array_equal(x, y).item()


def test_unknown_layout_refused(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="Unknown --layout columns; use one of"):
        convert(str(hf_dir), tmp_path / "x", progress=False, layout="columns")
    r = CliRunner().invoke(
        convert_main, [str(hf_dir), str(tmp_path / "x"), "--layout", "x"]
    )
    assert r.exit_code == 2 and "'x' is not one of 'rows', 'blocked'" in r.output
    assert not (tmp_path / "x").exists()


def test_cli_layout_and_info(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [str(hf_dir), str(out), "--bits", BITS4, "--layout", "blocked"]
    r = CliRunner().invoke(convert_main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "blocked by 16 rows" in r.output
    assert load_manifest(out).blocked
    r = CliRunner().invoke(cli, ["info", str(out)], catch_exceptions=False)
    assert "format v2" in r.output and "  layout:       blocked" in r.output
    r = CliRunner().invoke(cli, ["info", str(out), "--json"], catch_exceptions=False)
    assert json.loads(r.output)["layout"] == "blocked"


def test_gguf_export_equal_from_either_layout(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from moestream.bench.gguf_export import write_gguf

    src = tiny_qwen3_moe(tmp_path / "hf", mlp_only_layers=[])  # every layer MoE
    files = []
    for layout in ("rows", "blocked"):
        out = tmp_path / layout
        convert(str(src), out, bits=BITS4, progress=False, layout=layout)
        files.append(tmp_path / f"{layout}.gguf")
        write_gguf(out, files[-1], "q4_1")
    assert files[0].read_bytes() == files[1].read_bytes()


# ------------------------------------------------------------------ runtime


def _streaming(model) -> list[StreamingSwitchGLU]:
    return [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]


KERNEL = pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="needs the extension's exact CPU kernel",
)


@pytest.mark.parametrize("cache_experts", [8, 3])
@pytest.mark.parametrize(
    "cpu_kernel", [pytest.param(True, marks=KERNEL), False], ids=["kernel", "mlx"]
)
def test_python_engine_exact_on_blocked_records(
    blocked_out, resident_logits, cache_experts, cpu_kernel
) -> None:
    """Blocked records into blocked slots (the kernel) and into row-major
    slots (MLX's ops): mlx-lm's resident model's logits, bit for bit, with
    every expert in a slot and with misses."""
    model, _ = moestream.load(
        blocked_out,
        cache_experts=cache_experts,
        engine="python",
        cpu_kernel=cpu_kernel,
    )
    layers = _streaming(model)
    assert layers and all(m.blocked == cpu_kernel for m in layers)
    ours = logits_stepwise(model, PROMPT, steps=8)
    for step, (a, b) in enumerate(zip(ours, resident_logits(8), strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    assert (s.misses > 0) == (cache_experts < 8)
    assert s.evictions > 0 or cache_experts == 8


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"cpu_kernel": True, "arithmetic": "fast"}, marks=KERNEL),
        {"dtype": "bfloat16"},
    ],
    ids=["fast", "bfloat16"],
)
def test_row_major_slots_from_blocked_records(converted, blocked_out, options):
    """Where MLX's ops read the slots (the fast arithmetic, a compute dtype
    other than float32), blocked records are unblocked into them: the same
    logits as the rows conversion's."""
    a, _ = moestream.load(converted, cache_experts=3, engine="python", **options)
    b, _ = moestream.load(blocked_out, cache_experts=3, engine="python", **options)
    assert not any(m.blocked for m in _streaming(b))
    for x, y in zip(
        logits_stepwise(a, PROMPT, 4), logits_stepwise(b, PROMPT, 4), strict=True
    ):
        assert mx.array_equal(x, y).item()


@KERNEL
@pytest.mark.parametrize(
    "records, cpu_kernel, staged",
    [
        ("blocked", True, set()),  # blocked slots keep them as stored
        ("blocked", False, {"weight", "scales", "biases"}),  # unblocked
        ("rows", True, {"weight", "scales", "biases"}),  # blocked
        ("rows", False, {"scales", "biases"}),  # float32 row slots: cast only
    ],
)
def test_slot_fill_stages_only_what_it_must(
    converted, blocked_out, monkeypatch, records, cpu_kernel, staged
) -> None:
    """Segments stored as the slot holds them (layout and dtype) are read
    straight into the slot: no staging, no permutation."""
    seen: set[str] = set()
    write = SlotFiller._write

    def spy(self, seg, dst, dtype):
        seen.add(seg.name.rpartition(".")[2])
        write(self, seg, dst, dtype)

    monkeypatch.setattr(SlotFiller, "_write", spy)
    out = blocked_out if records == "blocked" else converted
    moestream.load(out, cache_experts=8, engine="python", cpu_kernel=cpu_kernel)
    assert seen == staged


def test_native_engine_on_a_gpu_refuses_blocked_records(
    converted, blocked_out, monkeypatch
) -> None:
    """The native engine's GPU path copies records as stored: one line, what
    to do. The python engine unblocks (allowed); a CPU's plan is unaffected."""
    blocked_manifest = load_manifest(blocked_out)
    with pytest.raises(native.NativeEngineError, match="--layout rows") as e:
        backend._check_records(blocked_manifest, "native", True)
    assert "\n" not in str(e.value) and "blocked for the CPU kernel" in str(e.value)
    backend._check_records(blocked_manifest, "python", True)
    backend._check_records(blocked_manifest, "native", False)
    backend._check_records(load_manifest(converted), "native", True)
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "_engine", lambda t, gpu: "native")
    from moestream.runtime.loader import execution_for

    with pytest.raises(native.NativeEngineError, match="--layout rows writes them so"):
        execution_for(blocked_out)


# ---------------------------------------------------------------- relayout
def test_relayout_equals_converting_the_source(
    converted: Path, blocked_out: Path, tmp_path: Path
) -> None:
    """convert-moe OUT NEW --layout blocked (and back): the bytes a
    conversion of the original checkpoint with that --layout writes."""
    convert(str(converted), tmp_path / "blocked", layout="blocked", progress=False)
    same_files(tmp_path / "blocked", blocked_out)
    convert(str(blocked_out), tmp_path / "rows", layout="rows", progress=False)
    same_files(tmp_path / "rows", converted)


def test_relayout_refuses_other_options_and_a_damaged_source(
    converted: Path, copy: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConvertError, match="only --layout can change") as e:
        convert(str(converted), tmp_path / "x", bits=BITS4, layout="blocked")
    assert "\n" not in str(e.value)
    with pytest.raises(ConvertError, match="already exists"):
        convert(str(converted), copy, layout="blocked")
    layer = load_manifest(copy).layers[0]
    with open(copy / layer.file, "r+b") as f:  # one byte of one record flipped
        f.seek(layer.data_offset + 3 * layer.stride + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(FormatError, match="expert 3 of layer") as e:
        convert(str(copy), tmp_path / "y", layout="blocked", progress=False)
    assert not (tmp_path / "y").exists()
    assert not any(tmp_path.glob(".y*"))  # nothing half-written is left


def test_cli_relayout(converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "blocked"
    r = CliRunner().invoke(
        convert_main, [str(converted), str(out), "--layout", "blocked"]
    )
    assert r.exit_code == 0, r.output
    assert "its records rewritten as blocked" in r.output
    assert load_manifest(out).blocked
