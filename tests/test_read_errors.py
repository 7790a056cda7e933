"""Read errors during generation: a clear error naming file, layer and expert;
the pool is not corrupted, and once the blob is back, output is exact again.

Written against the public API only (moestream.load, model calls, mlx_lm), so
it holds for either engine behind it: both raise ExpertReadError (an OSError)
with the same words, the native engine's from inside MLX's evaluation too.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import corrupt_layer
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.cli.run import main as run_main
from moestream.formats import load_manifest
from moestream.runtime import ExpertReadError, RuntimeConfig, loader, memory, native
from moestream.runtime.loader import plan_for

ENGINES = ["python"] + (["native"] if native.available() else [])

PROMPTS = [
    mx.array([[(13 * i + 7) % 300 for i in range(40)]]),
    mx.array([[(29 * i + 101) % 300 for i in range(40)]]),
]


@pytest.fixture
def copy(converted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(converted, out)
    return out


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def load(path: Path, engine: str, cache_experts: int):
    return moestream.load(path, cache_experts=cache_experts, engine=engine)


def forward(model, prompt: mx.array) -> mx.array:
    """A fresh KV cache per call: a failed call's cache is never reused."""
    out = model(prompt, cache=make_prompt_cache(model))
    mx.eval(out)
    return out


def assert_exact(model, reference) -> None:
    for p in PROMPTS:
        assert mx.array_equal(forward(model, p), reference(p)).item()


@pytest.mark.parametrize("keep", [0, 5000], ids=["all-records-gone", "mid-record"])
def test_truncated_under_running_process(copy, reference, engine, keep: int) -> None:
    layer = load_manifest(copy).layers[1]
    blob = copy / layer.file
    original = blob.read_bytes()
    model, _ = load(copy, engine, 2)
    forward(model, PROMPTS[0])  # warm: some experts resident, the rest evicted
    os.truncate(blob, layer.data_offset + keep)  # same inode: the open fd sees it
    with pytest.raises(ExpertReadError) as e:
        for p in PROMPTS:
            forward(model, p)
    message = str(e.value)
    assert str(blob) in message and f"of layer {layer.layer}" in message
    assert "Cannot read expert" in message and "\n" not in message
    assert isinstance(e.value, OSError)  # the CLIs print it as one line
    with open(blob, "r+b") as f:  # restored in place
        f.write(original)
    assert_exact(model, reference)  # no slot kept the failed read's bytes


def test_io_error_under_running_process(copy, reference, monkeypatch) -> None:
    """The python engine reads with os.preadv: a disk error on one read."""
    model, _ = moestream.load(copy, cache_experts=2, engine="python")
    forward(model, PROMPTS[0])
    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) in (3, 4):  # a few reads succeed, then a read and its retry
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(
        ExpertReadError, match=r"Cannot read expert \d+ of layer \d+ from "
    ):
        for p in PROMPTS:
            forward(model, p)
    monkeypatch.undo()
    assert_exact(model, reference)


def test_one_failed_read_heals_two_fail_the_call(copy, reference, monkeypatch):
    """The python engine's retry: a disk error on one read only is read again."""
    model, _ = moestream.load(copy, cache_experts=2, engine="python")
    forward(model, PROMPTS[0])
    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    assert_exact(model, reference)
    assert len(calls) > 3 and calls[2] == calls[3]  # the same record, again


def inject(model, engine: str, count: int) -> int:
    """The fault-injection hook: the next `count` reads of each record of the
    second MoE layer fail as an I/O error would; returns the layer's id."""
    rt = moestream.runtime_of(model)
    layer = rt.manifest.layers[1]
    for expert in range(layer.num_experts):
        if engine == "python":
            rt.store.inject_read_failures(layer.layer, expert, count)
        else:  # the native engine's, slots or mapped
            rt.stats.native_layers[layer.layer].inject_read_failures(expert, count)
    return layer.layer


def window_budget(path: Path, window: int, monkeypatch) -> int:
    """A memory budget that keeps `window` records a layer mapped (the
    process's bytes fixed, so the plan does not move between loads)."""
    measured = memory._process_bytes()
    monkeypatch.setattr(loader, "_process_bytes", lambda: measured)
    base = plan_for(path, RuntimeConfig(backend="mapped"))
    return int(base.total + (window + 0.5) * base.slot_bytes)


MAPPED = ["mapped", "mapped-window"] * native.available()


@pytest.mark.parametrize("how", ENGINES + MAPPED)
def test_injected_failures_heal_once_then_fail(
    copy, reference, how: str, monkeypatch
) -> None:
    """A record whose read fails once is read again and the call goes on; one
    that fails twice fails the call with the read's words; the engine is
    exact again once reads succeed. Fresh loads: a mapped record is read
    (checked) the first time it is routed; under a budget, the prompts are
    wider than the window, whose kernel maps and checks a record a thread."""
    options = {"engine": "native" if how != "python" else "python"}
    options.update({"cache_experts": 2} if how in ENGINES else {"backend": "mapped"})
    if how == "mapped-window":
        options["memory_budget"] = window_budget(copy, 3, monkeypatch)
    model, _ = moestream.load(copy, **options)
    inject(model, how, 1)
    assert_exact(model, reference)
    model, _ = moestream.load(copy, **options)
    layer = inject(model, how, 2)
    with pytest.raises(ExpertReadError, match=rf"read expert \d+ of layer {layer} "):
        for p in PROMPTS:
            forward(model, p)
    inject(model, how, 0)
    assert_exact(model, reference)
    rt = moestream.runtime_of(model)
    with pytest.raises(ValueError):
        if how == "python":
            rt.store.inject_read_failures(layer, 10**6, 1)
        else:
            rt.stats.native_layers[layer].inject_read_failures(10**6, 1)


def test_corrupt_record_fails_every_time_then_recovers(copy, reference, engine) -> None:
    """A checksum failure is not cached as success: it fails again until fixed."""
    layer = load_manifest(copy).layers[0]
    model, _ = load(copy, engine, 4)
    original = corrupt_layer(copy, layer)  # every expert of layer 0, same inode
    for _ in range(2):
        with pytest.raises(ExpertReadError, match=r"of layer 0 .* fails its"):
            forward(model, PROMPTS[0])
    (copy / layer.file).write_bytes(original)
    assert_exact(model, reference)


@pytest.mark.skipif(not native.available(), reason="no native extension")
def test_corrupt_record_fails_a_mapped_window_then_recovers(
    copy, reference, monkeypatch
) -> None:
    """The mapped backend under a budget, prompts wider than its window: a
    record that fails its checksum where the kernel maps and checks it fails
    the call with the check's words, every time, until the blob is fixed."""
    layer = load_manifest(copy).layers[0]
    budget = window_budget(copy, 3, monkeypatch)
    model, _ = moestream.load(copy, backend="mapped", memory_budget=budget)
    assert moestream.runtime_of(model).plan.window == 3
    assert_exact(model, reference)  # the window holds records, checked
    original = corrupt_layer(copy, layer)
    model, _ = moestream.load(copy, backend="mapped", memory_budget=budget)
    for _ in range(2):
        with pytest.raises(ExpertReadError, match=r"of layer 0 .* fails its"):
            forward(model, PROMPTS[0])
    (copy / layer.file).write_bytes(original)
    assert_exact(model, reference)


def test_blob_replaced_by_a_good_copy_heals(copy, reference, engine) -> None:
    """A bad blob replaced by rename (a good copy moved over it): the retry
    opens the path again, so the running process reads the good file."""
    layer = load_manifest(copy).layers[0]
    model, _ = load(copy, engine, 4)
    original = corrupt_layer(copy, layer)  # in place: the open file is bad
    with pytest.raises(ExpertReadError, match=r"of layer 0 .* fails its"):
        forward(model, PROMPTS[0])
    good = copy / f"{layer.file}.good"
    good.write_bytes(original)
    os.replace(good, copy / layer.file)  # a new inode under the same path
    assert_exact(model, reference)


def test_blob_removed_under_running_process(copy, reference, engine) -> None:
    """Unlinking does not pull the data away from an open file: still exact."""
    model, _ = load(copy, engine, 2)
    forward(model, PROMPTS[0])
    for layer in load_manifest(copy).layers:
        (copy / layer.file).unlink()
    assert_exact(model, reference)


def test_generate_surfaces_the_error(copy, reference, engine) -> None:
    layer = load_manifest(copy).layers[0]
    model, tokenizer = load(copy, engine, 2)
    os.truncate(copy / layer.file, layer.data_offset)
    with pytest.raises(ExpertReadError, match="layer 0"):
        generate(model, tokenizer, "def add(a, b):", max_tokens=4)


def test_run_moe_corrupt_expert_is_one_line(copy, engine) -> None:
    layer = load_manifest(copy).layers[0]
    with open(copy / layer.file, "r+b") as f:
        for e in range(layer.num_experts):
            f.seek(layer.data_offset + e * layer.stride + 3)
            f.write(b"\xee")
    r = CliRunner().invoke(
        run_main,
        [
            str(copy),
            "-p",
            "def",
            "-m",
            "3",
            *(["--set", "engine=native"] * (engine == "native")),
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 2
    (line,) = r.stderr.strip().split("\n")
    assert line.startswith("error: Expert ") and "fails its checksum" in line
