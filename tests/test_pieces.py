"""One record read in pieces over the reader threads: the CRCs of the pieces
combine into the record's (zlib's crc32_combine), the slots hold the same bytes
whatever the reader count, and a fault in any piece reads as it did whole. A
record the page cache holds is read whole on the calling thread instead (as
the records of these tests are): the piece tests turn that off, and the two
ways give the same slots."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, copy_of, corrupt_layer, logits_stepwise, tiny_converted

import moestream
from moestream.formats import Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import ExpertReadError, native, runtime_of

pytestmark = pytest.mark.skipif(
    not native.available(), reason="moestream's native engine is not built"
)

BITS = "gate_proj=4,up_proj=4,down_proj=8"
# 4-bit gate/up and 8-bit down of 256 x 1536: ~860 KB records, 4 pieces at 8
# readers (ExpertCache::kMinPiece is 256 KiB).
GEOMETRY = {
    "hidden_size": 256,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "num_experts": 6,
    "num_experts_per_tok": 2,
}


def in_pieces(model) -> None:
    """Every read of `model` in pieces, as if the page cache held nothing."""
    for layer in runtime_of(model).stats.native_layers.values():
        layer.read_cached_whole = False


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf, out = tiny_converted(tmp_path_factory.mktemp("pieces"), BITS, GEOMETRY)
    return hf, out


def test_crc32_combine_is_zlibs():
    rng = np.random.default_rng(1)
    crc32_combine = native._native.crc32_combine
    for a_len, b_len in [(0, 0), (0, 5), (5, 0), (1, 1), (4096, 3), (7, 1 << 20)]:
        a = rng.integers(0, 256, a_len, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, b_len, dtype=np.uint8).tobytes()
        whole = crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len)
        assert whole == zlib.crc32(a + b)


def test_records_span_several_pieces(big):
    _, out = big
    record = load_manifest(out).layers[0].record_nbytes
    assert record > 3 * (256 << 10)


@pytest.mark.parametrize("readers", [1, 3, 8, "whole"])
def test_pieces_give_the_resident_models_logits(big, readers: int | str):
    hf, out = big
    model, _ = moestream.load(
        out,
        cache_experts=2,
        engine="native",
        readers=8 if readers == "whole" else readers,
    )
    if readers != "whole":
        in_pieces(model)
    reference = resident_model(hf, Recipe.parse(BITS))
    ours = logits_stepwise(model, PROMPT, steps=6)
    theirs = logits_stepwise(reference, PROMPT, steps=6)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    assert (
        s.misses > 0
        and s.bytes_read == s.misses * load_manifest(out).layers[0].record_nbytes
    )


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_bad_piece_fails_the_checksum(big, tmp_path: Path, where: str):
    _, src = big
    out = copy_of(src, tmp_path)
    layer = load_manifest(out).layers[1]
    at = 7 if where == "first" else layer.record_nbytes - 3
    corrupt_layer(out, layer, at=at)
    model, _ = moestream.load(out, cache_experts=2, engine="native", readers=8)
    in_pieces(model)
    with pytest.raises(ExpertReadError, match="fails its checksum"):
        logits_stepwise(model, PROMPT, steps=2)


def test_a_record_cut_in_a_later_piece(big, tmp_path: Path):
    _, src = big
    out = copy_of(src, tmp_path)
    layer = load_manifest(out).layers[1]
    model, _ = moestream.load(out, cache_experts=2, engine="native", readers=8)
    in_pieces(model)
    # Past the first piece of expert 0: every record but part of the first is gone.
    os.truncate(out / layer.file, layer.data_offset + (600 << 10))
    with pytest.raises(ExpertReadError, match="lies past the end of the file"):
        logits_stepwise(model, PROMPT, steps=2)


@pytest.mark.parametrize("whole", [True, False])
def test_a_bad_record_fails_its_checksum_read_either_way(big, tmp_path, whole):
    _, src = big
    out = copy_of(src, tmp_path)
    layer = load_manifest(out).layers[0]
    corrupt_layer(out, layer, at=layer.record_nbytes // 2)
    model, _ = moestream.load(out, cache_experts=2, engine="native", readers=8)
    if not whole:
        in_pieces(model)
    with pytest.raises(ExpertReadError, match="fails its checksum"):
        logits_stepwise(model, PROMPT, steps=2)


def test_the_plan_counts_the_staging_records_the_reader_has():
    """The memory plan sizes as many staging records as the native reader
    reads a call's misses through."""
    from moestream.runtime.memory import STAGING_RECORDS

    assert native._native.staging_records == STAGING_RECORDS
