"""The native engine (compiled MLX extension) agrees with the Python reference
path and with mlx-lm's resident model bit for bit."""

from __future__ import annotations

import os
import platform
import re
import shutil
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, corrupt_layer, generated, logits_stepwise, tiny_converted

import moestream
from moestream.formats import Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import ExpertReadError, native
from moestream.runtime.switch import StreamingSwitchGLU

pytestmark = pytest.mark.skipif(
    not native.available(), reason="moestream's native engine is not built"
)


def test_crc32_is_zlibs():
    """Short lengths (tables), and every length and start around the folding
    path's edges (64 bytes, multiples of 16) and past them, any running CRC."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    lengths = [0, 1, 7, 8, 9, 4096 + 3, 1 << 16]
    lengths += [*range(48, 100), *range(120, 200, 7), *rng.integers(0, 1 << 16, 40)]
    for n in lengths:
        start = int(rng.integers(0, 17))
        data = block[start : start + n]
        crc = int(rng.integers(0, 2**32))
        assert native._native.crc32(data) == zlib.crc32(data), n
        assert native._native.crc32(data, crc) == zlib.crc32(data, crc), n


def test_a_waiter_waits_for_an_unneeded_output_only_when_nothing_else_holds_it():
    """An engine's waiter (mx.depends of one element on a layer's output)
    waits for nothing needed only while both are unevaluated and nothing
    else holds the output: no later evaluation can compute it then."""

    def waiter(y: mx.array) -> mx.array:
        return mx.depends([mx.zeros((1,))], [y])[0]

    x = mx.arange(8.0)
    y = x * 2
    w = waiter(y)
    assert not native.waits_for_unneeded(w)  # y is ours still
    del y
    assert native.waits_for_unneeded(w)
    y = x * 3
    held, w = y + 1, waiter(y)
    del y
    assert not native.waits_for_unneeded(w)  # `held` may compute it
    del held
    assert native.waits_for_unneeded(w)
    y = x * 4
    w = waiter(y)
    mx.eval(y)
    del y
    assert not native.waits_for_unneeded(w)  # scheduled: computed
    y = x * 5
    w = waiter(y)
    del y
    mx.eval(w)
    assert not native.waits_for_unneeded(w)
    a = x * 6
    b = a + x  # two inputs, the second alone held by it: not a waiter
    assert not native.waits_for_unneeded(b)


@pytest.mark.parametrize("cache_experts", [2, 5, 8])
@pytest.mark.parametrize("policy, prefetch", [("lrfu", True), ("lru", False)])
def test_native_logits_bit_identical(
    converted, reference, cache_experts, policy, prefetch
):
    model, _ = moestream.load(
        converted,
        cache_experts=cache_experts,
        policy=policy,
        prefetch=prefetch,
        engine="native",
    )
    ours = logits_stepwise(model, PROMPT, steps=12)
    theirs = logits_stepwise(reference, PROMPT, steps=12)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    if cache_experts == 8:  # read at load: decode never reaches the engine
        assert s.misses == s.native_calls == 0 and s.sync_free_calls == 26
        return
    assert s.native_calls > 0 and s.misses > 0 and s.evictions > 0
    assert s.grouped_calls > 0  # the 48-token prompt: host-side groups
    assert (s.prefetched > 0) == prefetch
    assert s.hits + s.misses > 0 and s.bytes_read > 0


def test_native_equals_python_engine_on_a_batch(converted):
    """Two sequences decoded at once: more routed experts per call."""
    prompt = mx.array([[5, 17, 33, 2], [90, 41, 7, 7]])
    out = {}
    for engine in ("python", "native"):
        model, _ = moestream.load(converted, cache_experts=4, engine=engine)
        out[engine] = logits_stepwise(model, prompt, steps=8)
    for a, b in zip(out["python"], out["native"], strict=True):
        assert mx.array_equal(a, b).item()


def test_native_sampled_tokens_identical(converted, hf_dir, recipe):
    prompt = [5, 17, 33, 2, 90, 41]
    ours = generated(
        lambda: moestream.load(converted, cache_experts=3, engine="native")[0],
        prompt,
        0.9,
        seed=11,
    )
    assert ours == generated(lambda: resident_model(hf_dir, recipe), prompt, 0.9, 11)
    assert len(set(ours)) > 1


def test_native_float16_slots_from_bfloat16_records_exact(converted, hf_dir, recipe):
    """bf16 records rounded into fp16 slots as MLX rounds them (csrc/cast.h):
    the same logits as mlx-lm's resident model in fp16, and the python engine."""
    from moestream.reference import resident_model

    ref = resident_model(hf_dir, recipe, compute_dtype="float16")
    prompt = PROMPT[:, :9]  # fp16 runs ~40x slower than fp32 on a CPU
    theirs = logits_stepwise(ref, prompt, 4)
    for engine in ("native", "python"):
        model, _ = moestream.load(
            converted, cache_experts=3, engine=engine, dtype="float16"
        )
        ours = logits_stepwise(model, prompt, 4)
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == mx.float16 and mx.array_equal(a, b).item()
        assert moestream.stats(model).misses > 0


def test_unknown_engine_is_one_line():
    with pytest.raises(ValueError, match="Unknown engine 'fast'"):
        moestream.runtime.config_from(engine="fast")


def streaming_layers(model) -> list[StreamingSwitchGLU]:
    found = [m for m in model.modules() if isinstance(m, StreamingSwitchGLU)]
    return sorted(found, key=lambda m: m._layer.layer)  # model order


def test_host_budget_on_a_cpu_is_one_line(converted):
    """The host tier on a CPU was deleted on 2026-12-04 (0.73x cold, 0.52x in
    RAM warm: it takes its memory from the page cache): asked, one line."""
    with pytest.raises(ValueError, match="on a CPU the page cache is the tier") as e:
        moestream.load(converted, cache_experts=3, engine="native", host_budget="1G")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="python engine has no host_budget"):
        moestream.load(converted, cache_experts=3, engine="python", host_budget="1G")


def test_run_moe_host_budget_on_a_cpu_is_one_line(converted):
    from click.testing import CliRunner

    from moestream.cli.run import main as run_main

    args = [str(converted), "-p", "def", "-m", "6", "--ignore-chat-template"]
    tier = ["--set", "engine=native", "--cache-experts", "3", "--host-budget", "64M"]
    r = CliRunner().invoke(run_main, [*args, *tier])
    assert r.exit_code != 0
    (line,) = r.stderr.strip().split("\n")
    assert "leave it unset" in line
    r = CliRunner().invoke(run_main, [*args, "--cache-experts", "3", "--stats"])
    assert r.exit_code == 0 and "host tier" not in r.stderr


def test_an_error_a_call_left_raises_its_class(copy):
    """A CUDA stream's host function cannot raise: the error it leaves in the
    cache is raised before the next call, ExpertReadError for a record's."""

    class Left:
        def __init__(self, error: str):
            self.error = error

        def take_error(self) -> str:
            return self.error

    model, _ = moestream.load(copy, cache_experts=2, engine="native")
    layer = load_manifest(copy).layers[0]
    os.truncate(copy / layer.file, layer.data_offset)  # every record gone
    with pytest.raises(ExpertReadError) as e:
        mx.eval(model(PROMPT))
    with pytest.raises(ExpertReadError, match="Cannot read expert"):
        native.check(Left(str(e.value)))
    with pytest.raises(native.NativeEngineError, match="more routed experts"):
        native.check(Left("more routed experts than slots in one call"))
    native.check(Left(""))


# Records that end inside a 4 KiB block, read in 3 pieces at 3 readers (the
# last one short): 824,320 bytes (ExpertCache::kMinPiece is 256 KiB).
PIECES_BITS = "gate_proj=4,up_proj=4,down_proj=8"
PIECES_GEOMETRY = {
    "hidden_size": 256,
    "moe_intermediate_size": 1472,
    "num_hidden_layers": 2,
    "mlp_only_layers": [],
    "num_experts": 6,
    "num_experts_per_tok": 2,
}


@pytest.fixture(scope="module")
def pieces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pieces")
    return tiny_converted(root, PIECES_BITS, PIECES_GEOMETRY)


@pytest.mark.parametrize("readers", [1, 3], ids=["1-reader", "3-readers"])
def test_records_read_in_pieces_give_the_resident_models_logits(pieces, readers):
    hf, out = pieces
    record = load_manifest(out).layers[0].record_nbytes
    assert record % 4096 and record > 2 * (256 << 10)
    ref = resident_model(hf, Recipe.parse(PIECES_BITS))
    theirs = logits_stepwise(ref, PROMPT, steps=6)
    model, _ = moestream.load(out, cache_experts=2, engine="native", readers=readers)
    ours = logits_stepwise(model, PROMPT, steps=6)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    assert s.misses > 0 and s.bytes_read > 0


def test_a_corrupt_last_piece_fails_its_checksum(pieces, tmp_path: Path):
    _, src = pieces
    out = tmp_path / "model"
    shutil.copytree(src, out)
    layer = load_manifest(out).layers[1]
    corrupt_layer(out, layer, at=layer.record_nbytes - 3)  # in the last piece
    model, _ = moestream.load(out, cache_experts=2, engine="native", readers=3)
    with pytest.raises(ExpertReadError, match="fails its checksum"):
        logits_stepwise(model, PROMPT, steps=2)


def test_a_record_past_the_end_of_the_file(pieces, tmp_path: Path):
    _, src = pieces
    out = tmp_path / "model"
    shutil.copytree(src, out)
    layer = load_manifest(out).layers[1]
    model, _ = moestream.load(out, cache_experts=2, engine="native")
    # Inside the last block of expert 0's record: its last read comes up short.
    os.truncate(out / layer.file, layer.data_offset + layer.record_nbytes - 5)
    with pytest.raises(ExpertReadError, match="lies past the end of the file"):
        logits_stepwise(model, PROMPT, steps=2)


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_cpu_slots_are_backed_by_huge_pages():
    """An expert's slots span many pages; with 4 KiB pages a decode step's
    reads miss the TLB on most of them. The slot arrays ask for huge pages
    (SlotArrays::bind, through this helper: what the kernel's transparent
    huge pages allow)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not native.available() or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    if release < (6, 1):
        pytest.skip("MADV_COLLAPSE (what the slots already hold) needs Linux 6.1")
    # A mapping of its own that no earlier test asked huge pages for: MLX's
    # cache (which would hand back a freed slot array) emptied first, and
    # past glibc's largest mmap threshold (32 MiB), so not inside the heap,
    # whose other parts may be on huge pages (smaps counts a whole mapping).
    mx.clear_cache()
    a = mx.ones((64 << 20,), mx.uint8)
    mx.eval(a)
    address = np.asarray(memoryview(a)).ctypes.data  # MLX's own buffer
    if "[madvise]" in thp.read_text():  # none unless asked for
        assert _huge_kb(address + (4 << 20)) == 0
    native._native.huge_pages(a)
    assert _huge_kb(address + (4 << 20)) >= 2048
    with pytest.raises(ValueError, match="an evaluated array"):
        native._native.huge_pages(mx.ones((4,)) + 1)
