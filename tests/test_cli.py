"""convert-moe and run-moe as a user runs them."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate as mlx_generate
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from moestream.cli.convert import main as convert_main
from moestream.cli.run import main as run_main
from moestream.generate import encode_prompt
from moestream.runtime import native


def run(args: list[str]):
    return CliRunner().invoke(run_main, args, catch_exceptions=False)


@pytest.mark.parametrize(
    "flags", [[], ["--set", "prefetch=on"], ["--set", "engine=python"]]
)
def test_run_json_matches_resident_greedy(converted: Path, reference, flags) -> None:
    r = run(
        [
            *flags,
            str(converted),
            "--prompt",
            "def add",
            "--max-tokens",
            "12",
            "--ignore-chat-template",
            "--cache-experts",
            "3",
            "--json",
        ]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    tok = load_tokenizer(converted)
    prompt = tok.encode("def add", add_special_tokens=True)
    want = [t for t, _ in generate_step(mx.array(prompt), reference, max_tokens=12)]
    if 0 in want:  # eos ends generation
        want = want[: want.index(0)]
    assert out["tokens"] == want
    assert out["text"] == mlx_generate(reference, tok, prompt, max_tokens=12)
    s = out["stats"]
    assert s["prompt_tokens"] == len(prompt) and s["generation_tokens"] == len(want)
    assert 0 <= s["hit_rate"] <= 1 and s["bytes_read"] > 0 and s["peak_memory"] > 0
    # The native engine prefetches when asked; python never does.
    prefetches = "prefetch=on" in flags
    assert (s["prefetched"] > 0) == (prefetches and native.available())


def test_run_streams_text_and_stats(converted: Path) -> None:
    r = CliRunner().invoke(
        run_main,
        [
            str(converted),
            "-p",
            "class",
            "-m",
            "8",
            "--stats",
            "--seed",
            "3",
            "--temp",
            "0.7",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "hit rate" in r.output


def test_chat_template_encoding_matches_mlx_lm(converted: Path) -> None:
    tok = load_tokenizer(converted)
    ids = encode_prompt(tok, "hello", ignore_chat_template=False)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tok.encode(text, add_special_tokens=False)
    assert encode_prompt(tok, "hello", True) == tok.encode("hello")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory-budget", "3Q"], "Cannot read size '3Q'"),
        (["--memory-budget", "1M"], "too small.*--memory-budget"),
        (["--cache-experts", "0"], "at least 1"),
    ],
)
def test_run_bad_flags_one_line(converted: Path, args: list[str], message: str) -> None:
    r = CliRunner().invoke(run_main, [str(converted), "-p", "x", *args])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    import re

    assert re.search(message, lines[0]), lines[0]


def test_run_missing_dir_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(run_main, [str(tmp_path / "nope"), "-p", "x"])
    assert r.exit_code == 2 and "not a directory" in r.output


def test_convert_cli(hf_dir: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        convert_main, [str(hf_dir), str(tmp_path / "o"), "--bits", "down_proj=6"]
    )
    assert r.exit_code == 0, r.output
    assert "MoE layers" in r.output and "bits per weight" in r.output
    again = CliRunner().invoke(convert_main, [str(hf_dir), str(tmp_path / "o")])
    assert again.exit_code == 2 and "already exists" in again.output
    bad = CliRunner().invoke(
        convert_main, [str(hf_dir), str(tmp_path / "p"), "--bits", "down_proj=7"]
    )
    assert bad.exit_code == 2 and "Impossible bit width 7" in bad.output
    forced = CliRunner().invoke(
        convert_main,
        [str(hf_dir), str(tmp_path / "o"), "--force", "--bits", "down_proj=8"],
    )
    assert forced.exit_code == 0, forced.output
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["recipe"]["experts"]["down_proj"] == 8


def test_console_scripts_and_module(converted: Path, monkeypatch, capsys) -> None:
    exe = Path(sys.executable).parent
    r = subprocess.run(  # the installed console script, as a user runs it
        [exe / "run-moe", str(converted), "-p", "def", "-m", "4", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens" in json.loads(r.stdout.strip().splitlines()[-1])
    # `python -m moestream --help`: the package's __main__, as runpy runs it
    # (in this process: a second interpreter would spend seconds importing)
    monkeypatch.setattr(sys, "argv", ["moestream", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("moestream", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "convert" in out and "run" in out
