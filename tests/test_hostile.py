"""Hand-written hostile inputs, each through the CLIs as a user meets them:
exit status 2, exactly one line on stderr, no traceback, nothing executed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import BITS, edit_manifest

from moestream.cli import main as moestream_main
from moestream.cli.convert import main as convert_main
from moestream.cli.run import main as run_main


def invoke(command, args: list[str]):
    # catch_exceptions=False: an exception the CLI lets through fails the test
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(r, pattern: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [x for x in r.stderr.split("\n") if x and "\r" not in x]  # minus tqdm
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.output
    assert re.search(pattern, lines[0]), lines[0]


def seg(i: int = 0, layer: int = 0):
    return lambda d: d["layers"][layer]["segments"][i]


# ------------------------------------------------------------- manifests


MANIFEST_CASES = {
    "negative data_offset": (
        lambda d: d["layers"][0].update(data_offset=-16384),
        "data_offset -16384",
    ),
    "negative stride": (lambda d: d["layers"][0].update(stride=-16384), "stride"),
    "negative expert count": (
        lambda d: d["layers"][0].update(num_experts=-1),
        "absurd expert count",
    ),
    "negative record size": (
        lambda d: d["layers"][0].update(record_nbytes=-1),
        "record size -1",
    ),
    "negative layer": (lambda d: d["layers"][0].update(layer=-1), "out of range"),
    "negative segment size": (
        lambda d: seg()(d).update(nbytes=-4),
        "does not match -4 bytes",
    ),
    "negative shape": (lambda d: seg()(d).update(shape=[-2, 64]), "bad shape"),
    "overflowing stride": (
        lambda d: d["layers"][0].update(stride=2**64),
        "absurd blob size",
    ),
    "overflowing data_offset": (
        lambda d: d["layers"][0].update(data_offset=2**63),
        "absurd header page",
    ),
    "huge header page": (
        lambda d: d["layers"][0].update(data_offset=2**32),
        "absurd header page",
    ),
    "overflowing layer": (lambda d: d["layers"][0].update(layer=2**32), "out of range"),
    "overflowing segment offset": (
        lambda d: seg(5)(d).update(offset=2**70),
        "segments end at",
    ),
    "overflowing shape": (
        lambda d: seg()(d).update(shape=[2**40, 2**40], nbytes=2**82),
        "does not match",
    ),
    "overflowing expert count": (
        lambda d: d["layers"][0].update(num_experts=2**40),
        "absurd expert count",
    ),
    "duplicate segment": (
        lambda d: d["layers"][0]["segments"].append(seg()(d)),
        "duplicate segment",
    ),
    "unknown mode": (lambda d: seg()(d).update(mode="nf4"), "unknown mode 'nf4'"),
    "unknown checksum": (lambda d: d.update(checksum_algorithm="md5"), "checksum"),
    "float where int": (lambda d: d["layers"][0].update(stride=16384.0), "integer"),
    "bool where int": (lambda d: d["layers"][0].update(stride=True), "integer"),
    "list where string": (lambda d: d["layers"][0].update(file=["x"]), "string"),
    "dict where list": (lambda d: d.update(layers={"0": 1}), "list"),
    "NUL in a file name": (lambda d: d["layers"][0].update(file="a\x00b"), "NUL"),
    "nameless segment": (lambda d: seg()(d).update(name="weight"), "projection"),
    "traversal via experts/": (
        lambda d: d["layers"][0].update(file="experts/../../x.blob"),
        "escapes",
    ),
    "dense file traversal": (lambda d: d.update(dense_files=["../d"]), "escapes"),
    "version 0": (lambda d: d.update(version=0), "Unsupported format version 0"),
    "version as string": (lambda d: d.update(version="1"), "Unsupported format"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_hostile_manifest(copy: Path, case: str) -> None:
    mutate, pattern = MANIFEST_CASES[case]
    edit_manifest(copy, mutate)
    assert_one_line_error(invoke(run_main, [copy, "-p", "x", "-m", "2"]), pattern)
    r = invoke(moestream_main, ["verify", copy, "-q"])
    assert r.exit_code == 1 and "BAD manifest.json" in r.output


@pytest.mark.parametrize(
    "write, pattern",
    [
        (lambda p: p.write_text("[" * 100_000), "nested absurdly deep"),
        (lambda p: p.write_bytes(b'{"format": "\xff\xfe"}'), "not valid JSON"),
        (lambda p: p.write_text("[1, 2]"), "not a moestream manifest"),
        (lambda p: p.write_text(""), "not valid JSON"),
        (lambda p: os.truncate(p, 65 << 20), "larger than"),  # sparse: no disk used
    ],
    ids=["deep", "not-utf8", "a-list", "empty", "huge"],
)
def test_hostile_manifest_file(copy: Path, write, pattern: str) -> None:
    write(copy / "manifest.json")
    assert_one_line_error(invoke(run_main, [copy, "-p", "x"]), pattern)


def test_manifest_symlink_outside(copy: Path, tmp_path: Path) -> None:
    shutil.move(copy / "manifest.json", tmp_path / "elsewhere.json")
    (copy / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    assert_one_line_error(invoke(run_main, [copy, "-p", "x"]), "outside")


def test_unknown_projection_refused_at_load(copy: Path) -> None:
    edit_manifest(copy, lambda d: seg()(d).update(name="evil_proj.weight"))
    assert_one_line_error(invoke(run_main, [copy, "-p", "x"]), "do not match")


def test_huge_sparse_blob_refused_before_allocation(copy: Path) -> None:
    """A consistent manifest and a 1 GiB-per-expert sparse blob (no disk used):
    refused by shape before any slot or staging memory is sized from it."""
    import mlx.core as mx

    from moestream.formats import load_manifest
    from moestream.formats.blob import pack_header
    from moestream.formats.manifest import record_layout, stride_for

    layer = load_manifest(copy).layers[0]
    segments, nbytes = record_layout([("gate_proj.weight", "uint8", (1 << 30,), None)])
    d = json.loads((copy / "manifest.json").read_text())
    entry = d["layers"][0]
    entry.update(
        # as format v1 writes a segment: no "layout" key
        segments=[
            {k: v for k, v in s.__dict__.items() if k != "layout"} for s in segments
        ],
        record_nbytes=nbytes,
        stride=stride_for(nbytes),
        checksums=["00000000"] * layer.num_experts,
    )
    (copy / "manifest.json").write_text(json.dumps(d))
    big = load_manifest(copy).layers[0]
    with open(copy / big.file, "wb") as f:
        f.write(pack_header(big))
        f.truncate(big.file_nbytes)  # 8 GiB, sparse
    mx.reset_peak_memory()
    r = invoke(run_main, [copy, "-p", "x", "--cache-experts", "2"])
    assert_one_line_error(r, "Layer 0: the blob's 8 experts .* do not match")
    assert mx.get_peak_memory() < 256 << 20


def test_absurd_layer_count_refused(hf_dir: Path, copy: Path, tmp_path: Path) -> None:
    """mlx-lm builds one object per layer: 2^31 layers would exhaust memory."""
    src = source_copy(hf_dir, tmp_path)
    for directory in (src, copy):
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(
            json.dumps({**cfg, "num_hidden_layers": 2**31 - 1})
        )
    r = invoke(convert_main, [src, tmp_path / "out"])
    assert_one_line_error(r, "asks for 2147483647 layers")
    r = invoke(run_main, [copy, "-p", "x", "--no-verify"])
    assert_one_line_error(r, "asks for 2147483647 layers")


@pytest.mark.parametrize("name", ["dense.safetensors", "tokenizer.json", "config.json"])
def test_changed_files_refused_unless_no_verify(copy: Path, name: str) -> None:
    """A flipped weight or vocabulary byte would compute silently wrong output."""
    path = copy / name
    data = bytearray(path.read_bytes())
    pos = len(data) - 200 if name == "dense.safetensors" else data.index(b'"') + 1
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    r = invoke(run_main, [copy, "-p", "x", "-m", "2"])
    assert_one_line_error(r, f"{name}: checksum mismatch.*--no-verify")
    if name == "dense.safetensors":  # the bytes still parse: the user may insist
        r = invoke(run_main, [copy, "-p", "x", "-m", "2", "--no-verify"])
        assert r.exit_code == 0


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (lambda p: _flip(p, 3), "header size .* is absurd"),
        (
            lambda p: _flip(p, p.read_bytes().index(b'"dtype":"') + 9),
            "cannot be read as",
        ),
        (lambda p: os.truncate(p, p.stat().st_size - 100), "describes"),
        (lambda p: shutil.copy(p.parent / "experts/layer-000.blob", p), "absurd"),
    ],
    ids=["header-length", "header-json", "truncated", "not-safetensors"],
)
def test_hostile_dense_file(copy: Path, damage, pattern: str) -> None:
    damage(copy / "dense.safetensors")
    r = invoke(run_main, [copy, "-p", "x", "-m", "2"])
    assert_one_line_error(r, "dense.safetensors: checksum mismatch")
    # without the checksum, the header checks still refuse it in one line
    r = invoke(run_main, [copy, "-p", "x", "-m", "2", "--no-verify"])
    assert_one_line_error(r, pattern)
    assert invoke(moestream_main, ["verify", copy, "-q"]).exit_code == 1


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x41
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("size", ["inf", "nan", "1e400", "-5G"])
def test_run_absurd_budget(converted: Path, size: str) -> None:
    r = invoke(run_main, [converted, "-p", "x", "--memory-budget", size])
    assert_one_line_error(r, "size|Size")


def test_run_out_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert_one_line_error(invoke(run_main, [tmp_path / "f", "-p", "x"]), "not a dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads through chmod 000")
def test_run_unreadable_manifest(copy: Path) -> None:
    (copy / "manifest.json").chmod(0)
    assert_one_line_error(invoke(run_main, [copy, "-p", "x"]), "Permission denied")


# ------------------------------------------------------------------ sources


def source_copy(hf_dir: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    return src


def test_remote_code_only_model_refused_and_never_run(
    hf_dir: Path, tmp_path: Path
) -> None:
    src = source_copy(hf_dir, tmp_path)
    marker = tmp_path / "EXECUTED"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (src / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(
        model_type="evil_moe",
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        },
    )
    (src / "config.json").write_text(json.dumps(cfg))
    r = invoke(convert_main, [src, tmp_path / "out"])
    assert_one_line_error(r, r"'evil_moe' is not supported \(.*remote code.*never run")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_remote_tokenizer_code_never_run(
    copy: Path, tmp_path: Path, monkeypatch
) -> None:
    """A supported model whose tokenizer asks for its own code: loaded without it."""
    import transformers

    marker = tmp_path / "EXECUTED"
    (copy / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast): pass\n"
    )
    tc = json.loads((copy / "tokenizer_config.json").read_text())
    tc.update(
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
    )
    (copy / "tokenizer_config.json").write_text(json.dumps(tc))
    from moestream.formats.verify import file_checksum

    # a hostile author recomputes the checksum: verification cannot help here
    crc = file_checksum(copy / "tokenizer_config.json")
    edit_manifest(
        copy, lambda d: d["file_checksums"].update({"tokenizer_config.json": crc})
    )
    calls = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs.get("trust_remote_code"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    r = CliRunner().invoke(run_main, [str(copy), "-p", "x", "-m", "2"])
    assert not marker.exists()
    assert calls and all(c is False for c in calls)
    assert r.exit_code in (0, 2) and "Traceback" not in r.output


def test_no_code_passes_trust_remote_code_true() -> None:
    root = Path(__file__).parent.parent / "moestream"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"trust_remote_code\W*(=|:)\s*True", text), path


def test_missing_shard(hf_dir: Path, tmp_path: Path) -> None:
    src = source_copy(hf_dir, tmp_path)
    (src / "model-00002-of-00002.safetensors").unlink()
    r = invoke(convert_main, [src, tmp_path / "out"])
    assert_one_line_error(
        r, r"Shard model-00002-of-00002.safetensors named in .* is missing"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "index, pattern",
    [
        ("{broken", "not a valid index"),
        ('{"weight_map": [1, 2]}', "no weight_map"),
        ('["a"]', "not a valid index"),
        ('{"weight_map": {"x": "../../etc/passwd"}}', "outside"),
        ('{"weight_map": {"x": "/etc/passwd"}}', "outside"),
    ],
)
def test_hostile_shard_index(hf_dir: Path, tmp_path: Path, index: str, pattern) -> None:
    src = source_copy(hf_dir, tmp_path)
    (src / "model.safetensors.index.json").write_text(index)
    assert_one_line_error(invoke(convert_main, [src, tmp_path / "out"]), pattern)


def test_truncated_shard(hf_dir: Path, tmp_path: Path) -> None:
    src = source_copy(hf_dir, tmp_path)
    shard = src / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    assert_one_line_error(invoke(convert_main, [src, tmp_path / "out"]), "Cannot read")
    assert not (tmp_path / "out").exists()


def test_pickle_and_unknown_type_via_cli(hf_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "pickle"
    src.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, src / f)
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not really")
    r = invoke(convert_main, [src, tmp_path / "out"])
    assert_one_line_error(r, "only pickle weights.*never loaded")


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("/nonexistent/model", "neither a directory nor a Hugging Face repo id"),
        ("./nope", "neither a directory nor a Hugging Face repo id"),
        ("a/b/c", "neither a directory nor a Hugging Face repo id"),
    ],
)
def test_nonexistent_source(tmp_path: Path, source: str, pattern: str) -> None:
    assert_one_line_error(invoke(convert_main, [source, tmp_path / "out"]), pattern)


def test_hub_failure_is_one_line(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your\n")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    r = invoke(convert_main, ["org/model", tmp_path / "out"])
    assert_one_line_error(r, "Cannot download org/model: We couldn't connect .* Check")


def test_out_parent_is_a_file(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    r = invoke(convert_main, [hf_dir, tmp_path / "file" / "out"])
    assert_one_line_error(r, "Cannot save to .*cannot create")


def test_out_is_an_existing_file(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "out").write_text("x")
    assert_one_line_error(invoke(convert_main, [hf_dir, tmp_path / "out"]), "exists")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_out_parent_unwritable(hf_dir: Path, tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        r = invoke(convert_main, [hf_dir, parent / "out", "--bits", BITS])
        assert_one_line_error(r, "not writable")
    finally:
        parent.chmod(0o700)
