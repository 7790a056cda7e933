"""RuntimeConfig.direct_io: the native engine reads records with O_DIRECT into
block-aligned buffers (the staging record, host tier records rounded up to
4 KiB), a record's tail that ends inside a block through a bounce block. The
slots hold the resident model's bytes whatever the readers and the tier, a
corrupt record still fails its checksum, and the reads skip the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import (
    PROMPT,
    corrupt_layer,
    direct_reads_refused,
    logits_stepwise,
    tiny_converted,
)

import moestream
from moestream.bench.sysio import drop_cache
from moestream.formats import Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import ExpertReadError, RuntimeConfig, config_from, native
from moestream.runtime.backend import DIRECT_ALIGN
from moestream.runtime.loader import execution_for, plan_for

pytestmark = pytest.mark.skipif(
    not native.available(), reason="moestream's native engine is not built"
)

BITS = "gate_proj=4,up_proj=4,down_proj=8"
# 824,320-byte records (201.25 blocks of 4 KiB: the tail path), 3
# pieces at 3 readers (ExpertCache::kMinPiece is 256 KiB).
GEOMETRY = {
    "hidden_size": 256,
    "moe_intermediate_size": 1472,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "num_experts": 6,
    "num_experts_per_tok": 2,
}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf, out = tiny_converted(tmp_path_factory.mktemp("direct"), BITS, GEOMETRY)
    reason = direct_reads_refused(out / load_manifest(out).layers[0].file)
    if reason:
        pytest.skip(reason)
    return hf, out


@pytest.fixture(scope="module")
def reference_logits(big) -> list[mx.array]:
    hf, _ = big
    return logits_stepwise(resident_model(hf, Recipe.parse(BITS)), PROMPT, steps=6)


def _caches(model) -> list:
    return list(moestream.runtime_of(model).stats.native_layers.values())


def test_records_end_inside_a_block(big):
    _, out = big
    record = load_manifest(out).layers[0].record_nbytes
    assert record % DIRECT_ALIGN and record > 2 * (256 << 10)


@pytest.mark.parametrize(
    "readers, host_budget",
    [(1, None), (3, None), (3, "8M")],
    ids=["1-reader", "3-readers", "3-readers-tier"],
)
def test_direct_reads_give_the_resident_models_logits(
    big, reference_logits, readers: int, host_budget: str | None
):
    _, out = big
    model, _ = moestream.load(
        out,
        cache_experts=2,
        engine="native",
        readers=readers,
        host_budget=host_budget,
        direct_io=True,
    )
    ours = logits_stepwise(model, PROMPT, steps=6)
    for step, (a, b) in enumerate(zip(ours, reference_logits, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    assert s.misses > 0 and s.bytes_read > 0
    caches = _caches(model)
    assert caches and all(c.direct for c in caches)
    # Every destination was block-aligned: nothing went through the page cache.
    assert [c.unaligned_reads for c in caches] == [0] * len(caches)


def test_the_tier_rounds_its_records_up_to_a_block(big):
    _, out = big
    record = load_manifest(out).layers[0].record_nbytes
    plain = plan_for(out, RuntimeConfig(cache_experts=2, host_budget="8M"))
    direct = plan_for(
        out, config_from(cache_experts=2, host_budget="8M", direct_io=True)
    )
    assert plain.host_record == record
    assert direct.host_record == -(-record // DIRECT_ALIGN) * DIRECT_ALIGN
    assert direct.host_tier == direct.host_records * direct.host_record <= 8 << 20


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a read-only mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        libc.munmap(addr, size)


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
def test_direct_reads_skip_the_page_cache(big, tmp_path: Path, direct_io: bool):
    _, src = big
    out = tmp_path / "model"
    shutil.copytree(src, out)
    layer = load_manifest(out).layers[1]
    blob = out / layer.file
    model, _ = moestream.load(
        out, cache_experts=2, engine="native", prefetch=False, direct_io=direct_io
    )
    os.sync()  # the copy's dirty pages, so that DONTNEED drops them
    drop_cache(blob)
    before = _resident_pages(blob)
    logits_stepwise(model, PROMPT, steps=3)
    misses = moestream.stats(model).misses
    read = _resident_pages(blob) - before
    record_pages = layer.record_nbytes // mmap.PAGESIZE
    assert misses > 0
    if direct_io:
        assert read == 0
    else:  # not a check of the kernel's caching, only that this one differs
        assert read >= record_pages


def test_a_corrupt_record_still_fails_its_checksum(big, tmp_path: Path):
    _, src = big
    out = tmp_path / "model"
    shutil.copytree(src, out)
    layer = load_manifest(out).layers[1]
    corrupt_layer(out, layer, at=layer.record_nbytes - 3)  # in the tail block
    model, _ = moestream.load(
        out, cache_experts=2, engine="native", readers=3, direct_io=True
    )
    with pytest.raises(ExpertReadError, match="fails its checksum"):
        logits_stepwise(model, PROMPT, steps=2)


def test_a_record_past_the_end_of_the_file(big, tmp_path: Path):
    _, src = big
    out = tmp_path / "model"
    shutil.copytree(src, out)
    layer = load_manifest(out).layers[1]
    model, _ = moestream.load(out, cache_experts=2, engine="native", direct_io=True)
    # Inside the last block of expert 0's record: its tail read comes up short.
    os.truncate(out / layer.file, layer.data_offset + layer.record_nbytes - 5)
    with pytest.raises(ExpertReadError, match="lies past the end of the file"):
        logits_stepwise(model, PROMPT, steps=2)


def test_the_python_engine_refuses_direct_io(big):
    _, out = big
    with pytest.raises(ValueError, match="python engine has no direct_io"):
        execution_for(out, config_from(engine="python", direct_io=True))


def test_a_filesystem_without_o_direct_is_one_line_at_load(big, tmp_path: Path):
    shm = Path("/dev/shm")
    _, src = big
    if not shm.is_dir():
        pytest.skip("no /dev/shm (tmpfs) here")
    out = Path(os.environ.get("MOESTREAM_TMPFS", shm)) / f"direct-{os.getpid()}"
    shutil.copytree(src, out)
    try:
        if direct_reads_refused(out / load_manifest(out).layers[0].file) is None:
            pytest.skip("this kernel's tmpfs takes O_DIRECT (Linux >= 6.6)")
        with pytest.raises(native.NativeEngineError) as e:
            moestream.load(out, cache_experts=2, engine="native", direct_io=True)
        message = str(e.value)
        assert "\n" not in message and "leave direct_io off" in message
        assert str(out) in message
    finally:
        shutil.rmtree(out)
