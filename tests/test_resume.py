"""Interrupted and failing conversions: never a valid-looking OUT; --resume is exact."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders.synthetic import HUB_LAYOUTS
from click.testing import CliRunner
from helpers import BITS, same_files

import moestream.converter.pack as pack
import moestream.formats.writer as writer
from moestream.cli.convert import main as convert_main
from moestream.converter import ConvertError, convert
from moestream.converter.resume import ResumeError, partial_dir
from moestream.formats import FormatError, ModelWriter, load_manifest

KILLER = Path(__file__).parent / "killed_convert.py"


def assert_not_valid(out: Path) -> None:
    """What a kill may leave: no OUT, or one the loader refuses."""
    if out.exists():
        with pytest.raises(FormatError):
            load_manifest(out)


class Interrupt(BaseException):
    """Stands in for Ctrl-C / a crash at a chosen point."""


def interrupt_after(monkeypatch, name: str, n: int, owner: object = pack) -> None:
    original, calls = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Interrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def count_calls(monkeypatch, name: str) -> list:
    original, calls = getattr(pack, name), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(pack, name, wrapper)
    return calls


def test_resume_reuses_finished_layers_byte_identical(
    hf_dir: Path, converted: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    interrupt_after(monkeypatch, "_write_layer", 2)  # layer 0 done, layer 2 not
    with pytest.raises(Interrupt):
        convert(str(hf_dir), out, bits=BITS, progress=False)
    monkeypatch.undo()
    assert not out.exists()
    journal = json.loads((partial_dir(out) / "journal.json").read_text())
    assert [e["layer"] for e in journal["layers"]] == [0]
    with pytest.raises(ResumeError, match=r"interrupted conversion; pass --resume"):
        convert(str(hf_dir), out, bits=BITS, progress=False)
    blob0 = partial_dir(out) / "experts/layer-000.blob"
    inode = blob0.stat().st_ino
    written = count_calls(monkeypatch, "_write_layer")
    convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    assert [args[2] for args in written] == [2]  # only the unfinished layer
    assert (out / "experts/layer-000.blob").stat().st_ino == inode  # reused as is
    assert not partial_dir(out).exists()
    same_files(out, converted)


def test_resume_of_blocked_records(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """An interrupted --layout blocked conversion resumes with --layout blocked
    only (its journal holds blocked layers), to the bytes of one run."""
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    convert(str(hf_dir), fresh, bits=BITS, progress=False, layout="blocked")
    interrupt_after(monkeypatch, "_write_layer", 2)
    with pytest.raises(Interrupt):
        convert(str(hf_dir), out, bits=BITS, progress=False, layout="blocked")
    monkeypatch.undo()
    with pytest.raises(ResumeError, match=r"different layout; resume with the same"):
        convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    written = count_calls(monkeypatch, "_write_layer")
    convert(str(hf_dir), out, bits=BITS, progress=False, resume=True, layout="blocked")
    assert [args[2] for args in written] == [2]  # layer 0 reused, blocked
    same_files(out, fresh)


def test_resume_redoes_a_damaged_layer(
    hf_dir: Path, converted: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    interrupt_after(monkeypatch, "write_config", 1, ModelWriter)  # both layers done
    with pytest.raises(Interrupt):
        convert(str(hf_dir), out, bits=BITS, progress=False)
    monkeypatch.undo()
    blob = partial_dir(out) / "experts/layer-002.blob"
    with open(blob, "r+b") as f:
        f.seek(40000)
        f.write(b"\xff")
    (partial_dir(out) / "junk.txt").write_text("stale")  # swept, not published
    (partial_dir(out) / "experts/layer-007.blob.tmp").write_bytes(b"half")
    written = count_calls(monkeypatch, "_write_layer")
    convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    assert [args[2] for args in written] == [2]
    same_files(out, converted)


@pytest.mark.parametrize(
    "options, changed",
    [
        ({"bits": "down_proj=8"}, "recipe"),
        ({"bits": BITS, "dtype": "float32"}, "dtype"),
        ({"bits": BITS, "layout": "blocked"}, "layout"),
    ],
)
def test_resume_refuses_other_options_or_source(
    hf_dir: Path, tmp_path: Path, monkeypatch, options, changed
) -> None:
    out = tmp_path / "out"
    interrupt_after(monkeypatch, "_write_layer", 2)
    with pytest.raises(Interrupt):
        convert(str(hf_dir), out, bits=BITS, progress=False)
    monkeypatch.undo()
    with pytest.raises(
        ResumeError, match=rf"different {changed}; resume with the same"
    ):
        convert(str(hf_dir), out, progress=False, resume=True, **options)
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    with pytest.raises(ResumeError, match=r"different source;"):
        convert(str(src), out, bits=BITS, progress=False, resume=True)
    assert not out.exists() and partial_dir(out).is_dir()  # kept for a correct resume


def test_failure_before_any_layer_leaves_nothing(
    hf_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    interrupt_after(monkeypatch, "_write_layer", 1)
    with pytest.raises(Interrupt):
        convert(str(hf_dir), tmp_path / "out", bits=BITS, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resume_without_partial_converts(
    hf_dir: Path, converted: Path, tmp_path: Path
) -> None:
    convert(str(hf_dir), tmp_path / "out", bits=BITS, progress=False, resume=True)
    same_files(tmp_path / "out", converted)


# -------------------------------------------------------------- real SIGKILLs

# (module, function, nth call at which the process SIGKILLs itself)
KILL_POINTS = [
    ("os", "fsync", 1),  # the empty journal is being written
    ("os", "fsync", 2),  # layer 0's blob written, not yet renamed
    ("os", "fsync", 3),  # layer 0's blob renamed, journal not yet updated
    ("moestream.converter.pack", "pack_record", 11),  # mid-way through layer 2's blob
    ("os", "fsync", 6),  # manifest.json being written
    ("os", "replace", 7),  # everything written, the final rename not done
]


class Killer:
    """tests/killed_convert.py's fork server: each conversion is a fresh child
    of a process that imported moestream once (a second, not one per kill)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(KILLER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _answer(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        assert ready, "the conversion did not end within 120 s"
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def start(self, point: tuple[str, str, int] | None, args: list) -> int:
        """Fork a conversion; its pid."""
        job = {"point": point, "args": [str(a) for a in args]}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._answer()["pid"]

    def wait(self) -> int:
        """The conversion's exit status, as subprocess gives it."""
        return self._answer()["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def killer():
    k = Killer()
    yield k
    k.close()


def run_killed(killer: Killer, point: tuple[str, str, int], args: list) -> int:
    killer.start(point, args)
    return killer.wait()


@pytest.mark.parametrize("point", KILL_POINTS, ids=lambda p: f"{p[1]}#{p[2]}")
def test_sigkill_then_resume_byte_identical(
    hf_dir: Path, converted: Path, tmp_path: Path, point, killer
) -> None:
    out = tmp_path / "out"
    rc = run_killed(killer, point, [hf_dir, out, "--bits", BITS])
    assert rc == -signal.SIGKILL, "the kill point was never reached"
    assert_not_valid(out)
    r = CliRunner().invoke(convert_main, [str(hf_dir), str(out), "--bits", BITS])
    assert r.exit_code == 2 and "--resume" in r.output
    convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    same_files(out, converted)


def test_sigkill_from_outside_then_resume(
    hf_dir: Path, converted: Path, tmp_path: Path, killer
) -> None:
    """Killed by another process as soon as the first blob appears."""
    out = tmp_path / "out"
    pid = killer.start(None, [hf_dir, out, "--bits", BITS])
    experts = partial_dir(out) / "experts"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / "manifest.json").exists():
        if experts.is_dir() and any(experts.iterdir()):
            with contextlib.suppress(ProcessLookupError):  # it may have ended
                os.kill(pid, signal.SIGKILL)  # the child: the server reaps it
            break
        time.sleep(0.0005)
    rc = killer.wait()
    if rc == -signal.SIGKILL:
        assert_not_valid(out)
        args = [str(hf_dir), str(out), "--bits", BITS, "--resume"]
        r = CliRunner().invoke(convert_main, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
    same_files(out, converted)


# ------------------------------------------------------------------ disk full


def test_disk_full_is_one_clean_line(
    hf_dir: Path, converted: Path, tmp_path: Path, monkeypatch
) -> None:
    """ENOSPC in the middle of layer 2's blob: one line, no partial blob, resumable."""
    import moestream.formats.blob as blob

    real_open, written = open, []

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            written.append(len(data))
            if len(written) > 10:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "layer-002" in str(path) else f

    monkeypatch.setattr(blob, "open", full_open, raising=False)
    out = tmp_path / "out"
    r = CliRunner().invoke(convert_main, [str(hf_dir), str(out), "--bits", BITS])
    assert r.exit_code == 2
    # tqdm's bar lines end in \r; everything else must be the one error line
    (line,) = [x for x in r.output.split("\n") if x and "\r" not in x]
    assert line.startswith("error: No space left on device writing ")
    assert "layer-002.blob.tmp" in line and "--resume" in line and "free on" in line
    assert not out.exists()
    leftovers = sorted(
        str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()
    )
    assert leftovers == [
        "out.partial/.lock",
        "out.partial/experts/layer-000.blob",
        "out.partial/journal.json",
    ]  # the half-written layer-002 blob is gone
    monkeypatch.undo()
    convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    same_files(out, converted)


def test_disk_full_in_dense_write(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    def full(path, arrays):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(writer, "_save_safetensors", full)
    with pytest.raises(ConvertError, match=r"No space left .*dense\.safetensors"):
        convert(str(hf_dir), tmp_path / "out", bits=BITS, progress=False)
    assert not (tmp_path / "out").exists()


def test_dense_safetensors_write_reports_enospc(tmp_path: Path) -> None:
    """MLX writing through a Python file raises OSError(ENOSPC) on a full disk."""
    import mlx.core as mx

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    (tmp_path / "x.safetensors").symlink_to("/dev/full")
    with pytest.raises(OSError) as e:
        writer._save_safetensors(
            tmp_path / "x.safetensors", {"a": mx.zeros((512, 512))}
        )
    assert e.value.errno == errno.ENOSPC


def test_concurrent_conversion_into_the_same_out_refused(
    hf_dir: Path, tmp_path: Path
) -> None:
    import fcntl

    out = tmp_path / "out"
    partial_dir(out).mkdir()
    with open(partial_dir(out) / ".lock", "w") as held:  # another convert-moe
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ResumeError, match="Another convert-moe is writing"):
            convert(str(hf_dir), out, bits=BITS, progress=False, resume=True)
    assert partial_dir(out).is_dir() and not out.exists()


# ------------------------------------------- every family and source layout


def _interrupted_then_resumed(src: Path, tmp_path: Path, monkeypatch, bits) -> None:
    whole = tmp_path / "whole"
    convert(str(src), whole, bits=bits, progress=False)
    out = tmp_path / "out"
    interrupt_after(monkeypatch, "_write_layer", 2)  # the first MoE layer done
    with pytest.raises(Interrupt):
        convert(str(src), out, bits=bits, progress=False)
    monkeypatch.undo()
    written = count_calls(monkeypatch, "_write_layer")
    convert(str(src), out, bits=bits, progress=False, resume=True)
    moe_layers = len(load_manifest(out).layers)
    assert len(written) == moe_layers - 1  # the finished layer was reused
    same_files(out, whole)


def _family_case(family: str, tmp_path: Path, monkeypatch) -> None:
    from builders.synthetic import tiny_model

    src = tiny_model(tmp_path / "hf", family, seed=3)
    bits = None if family == "gpt_oss" else "down_proj=6"  # MXFP4 kept as shipped
    _interrupted_then_resumed(src, tmp_path, monkeypatch, bits)


@pytest.mark.parametrize("family", sorted(HUB_LAYOUTS))
def test_resume_byte_identical_per_family(family, tmp_path, monkeypatch) -> None:
    _family_case(family, tmp_path, monkeypatch)


@pytest.mark.parametrize("layout", ["fused", "fp8", "mlx"])
def test_resume_byte_identical_per_source_layout(
    hf_dir, layout, tmp_path, monkeypatch
) -> None:
    from builders.synthetic_sources import to_fp8, to_fused, to_mlx

    make = {"fused": to_fused, "fp8": to_fp8, "mlx": to_mlx}[layout]
    src = make(hf_dir, tmp_path / layout)
    _interrupted_then_resumed(src, tmp_path, monkeypatch, "down_proj=8")
