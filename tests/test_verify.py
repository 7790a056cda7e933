"""`moestream verify OUT`: every flaw in a converted directory is found and named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import moestream
from moestream.cli import main as moestream_main
from moestream.formats import FormatError, load_manifest
from moestream.formats.verify import verify


@pytest.fixture
def copy(converted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(converted, out)
    return out


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def cli(path: Path):
    return CliRunner().invoke(moestream_main, ["verify", str(path), "-q"])


def test_intact_model_verifies(converted: Path) -> None:
    report = moestream.verify(converted)
    assert report.ok, report.problems
    m = load_manifest(converted)
    assert report.experts == sum(layer.num_experts for layer in m.layers) == 16
    assert report.bytes_read == m.total_bytes
    r = cli(converted)
    assert r.exit_code == 0 and r.output.startswith("OK "), r.output


def test_every_bad_expert_and_file_is_named(copy: Path) -> None:
    m = load_manifest(copy)
    l0, l2 = m.layers
    flip(copy / l0.file, l0.data_offset + 1 * l0.stride + 10)  # expert 1
    flip(copy / l0.file, l0.data_offset + 2 * l0.stride + 99)  # expert 2
    flip(copy / l0.file, l0.data_offset + 6 * l0.stride + 5)  # expert 6
    flip(copy / l2.file, l2.data_offset + 7 * l2.stride - 1)  # padding of expert 6
    flip(copy / l2.file, 20)  # header field
    flip(copy / "dense.safetensors", 3)  # header length
    problems = verify(copy).problems
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    assert "layer-000.blob (layer 0): checksum mismatch in experts 1-2, 6" in text
    assert "layer-002.blob (layer 2): header does not match" in text
    assert "layer-002.blob (layer 2): nonzero padding after expert 6" in text
    assert "dense.safetensors: header size" in text
    assert "dense.safetensors: checksum mismatch" in text
    r = cli(copy)
    assert r.exit_code == 1
    bad = [line for line in r.output.splitlines() if line.startswith("BAD ")]
    assert len(bad) == 5 and "FAILED" in r.output.splitlines()[-1]
    assert "Traceback" not in r.output


def test_dense_config_and_tokenizer_contents_checked(copy: Path) -> None:
    """A flipped weight byte leaves the safetensors header intact: crc32 finds it."""
    size = (copy / "dense.safetensors").stat().st_size
    flip(copy / "dense.safetensors", size - 1000)
    flip(copy / "tokenizer.json", 50)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert sorted(verify(copy).problems) == [
        "config.json: checksum mismatch",
        "dense.safetensors: checksum mismatch",
        "tokenizer.json: checksum mismatch",
    ]


def test_truncated_and_missing_files(copy: Path) -> None:
    m = load_manifest(copy)
    l0, l2 = m.layers
    with open(copy / l0.file, "r+b") as f:
        f.truncate(l0.data_offset + 5 * l0.stride + 100)  # experts 5-7 cut off
    (copy / l2.file).unlink()
    problems = verify(copy).problems
    assert any("layer-000.blob (layer 0): truncated" in p for p in problems)
    assert any("experts 5-7 lie beyond end of file" in p for p in problems)
    assert any("layer-002.blob (layer 2): cannot be opened" in p for p in problems)


def test_bad_manifest_and_config_reported(copy: Path) -> None:
    (copy / "config.json").write_text("{")
    unreadable, changed = sorted(verify(copy).problems)
    assert unreadable.startswith("config.json: cannot be read")
    assert changed == "config.json: checksum mismatch"
    d = json.loads((copy / "manifest.json").read_text())
    d["layers"][0]["stride"] = 1000
    (copy / "manifest.json").write_text(json.dumps(d))
    (problem,) = verify(copy).problems
    assert problem.startswith("manifest.json:") and "stride 1000" in problem
    assert cli(copy).exit_code == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("b"), "gap|describes"),
        (
            lambda d: d.update(
                extra={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
            ),
            "gap or overlap",
        ),
        (lambda d: d["b"].update(shape=[99]), "shape needs"),
        (lambda d: d["b"].update(dtype="Q7"), "malformed"),
    ],
)
def test_safetensors_header_checks(tmp_path: Path, mutate, message: str) -> None:
    import mlx.core as mx

    from moestream.formats.verify import check_safetensors

    mx.save_safetensors(
        str(tmp_path / "x.safetensors"),
        {"a": mx.zeros((3, 4)), "b": mx.zeros((5,), mx.uint8)},
    )
    assert check_safetensors(tmp_path, "x.safetensors") == []
    data = (tmp_path / "x.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    raw = json.dumps(header).encode()
    (tmp_path / "y.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    )
    (problem,) = check_safetensors(tmp_path, "y.safetensors")
    assert re.search(message, problem), problem


def test_claims_of_huge_records_cost_no_memory(copy: Path) -> None:
    """A manifest may claim 4 GiB strides; verify reads in bounded pieces."""
    from moestream.units import peak_rss

    d = json.loads((copy / "manifest.json").read_text())
    d["layers"][0].update(stride=2**32)
    (copy / "manifest.json").write_text(json.dumps(d))
    before = peak_rss()
    problems = verify(copy).problems
    assert any("layer-000.blob (layer 0): truncated" in p for p in problems)
    assert any("experts 1-7 lie beyond end of file" in p for p in problems)
    grown = peak_rss() - before
    assert grown < 64 << 20


def test_not_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="not a directory"):
        verify(tmp_path / "nope")
    r = CliRunner().invoke(moestream_main, ["verify", str(tmp_path / "nope")])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and r.output.startswith("error: ")
