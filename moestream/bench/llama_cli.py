"""moestream bench llama-cpp build | pack | gguf | compare"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from ..errors import user_errors
from ..options import CONTEXT, common_options
from ..units import human_bytes

BUILD = Path("build")
F = TypeVar("F", bound=Callable)


@click.group(context_settings=CONTEXT)
def llama_group() -> None:
    """llama.cpp as a peer: build llama-bench from PyPI's source, GGUF, compare."""


@llama_group.command("build", context_settings=CONTEXT)
@click.option(
    "--cuda", is_flag=True, help="The CUDA variant (sm_90), not the native CPU one."
)
@click.option(
    "--ik",
    is_flag=True,
    help="ik_llama.cpp (CPU) from ik-llama-cpp-python's source, not llama.cpp.",
)
@click.option(
    "--build-dir", type=click.Path(path_type=Path), default=BUILD, show_default=True
)
@click.option(
    "--jobs", type=int, default=None, help="Compile jobs (default: every core)."
)
@common_options
def build_cmd(cuda: bool, ik: bool, build_dir: Path, jobs: int | None) -> None:
    """Download llama-cpp-python's source from PyPI once (or unpack a carried
    `pack`), build llama-bench once into BUILD_DIR/llama.cpp-<variant>/
    (--ik: BUILD_DIR/ik_llama.cpp-cpu/)."""
    from .llama_cpp import build_llama

    def run() -> None:
        start = time.perf_counter()
        variant = "ik" if ik else "cuda" if cuda else "cpu"
        exe = build_llama(build_dir, variant, jobs)
        click.echo(f"{exe} ({time.perf_counter() - start:.0f} s)")

    user_errors(run)


@llama_group.command("pack", context_settings=CONTEXT)
@click.option(
    "--build-dir", type=click.Path(path_type=Path), default=BUILD, show_default=True
)
@common_options
def pack_cmd(build_dir: Path) -> None:
    """Write the trimmed llama.cpp source (to carry to a machine without network;
    `build` there unpacks it)."""
    from .llama_cpp import pack_source

    def run() -> None:
        out = pack_source(build_dir)
        click.echo(f"{out} ({human_bytes(out.stat().st_size)})")

    user_errors(run)


@llama_group.command("gguf", context_settings=CONTEXT)
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--quant",
    type=click.Choice(["q4_1", "q4_0"]),
    default="q4_1",
    show_default=True,
    help="q4_1: MLX's values (5.0 bits/weight); q4_0: its bits (4.5), requantized.",
)
@click.option(
    "--build-dir",
    type=click.Path(path_type=Path),
    default=BUILD,
    show_default=True,
    help="Where llama.cpp's source is (its gguf-py, if gguf is not installed).",
)
@common_options
def gguf_cmd(model: Path, out: Path, quant: str, build_dir: Path) -> None:
    """Write MODEL's weights (a converted qwen3_moe) as a GGUF file."""
    from .gguf_export import write_gguf
    from .llama_cpp import SOURCE_DIR

    def run() -> None:
        if out.exists():
            raise FileExistsError(f"{out} exists; remove it or choose another name.")
        start = time.perf_counter()
        s = write_gguf(model, out, quant, build_dir / SOURCE_DIR)
        click.echo(
            f"wrote {out}: {human_bytes(s['file_bytes'])}, experts "
            f"{s['expert_bits_per_weight']:.2f} bits/weight, all tensors "
            f"{s['bits_per_weight']:.2f} ({time.perf_counter() - start:.0f} s)"
        )

    user_errors(run)


def _gguf_option(text: str) -> tuple[str, Path]:
    label, eq, path = text.partition("=")
    if not eq:
        path, label = label, Path(label).stem
    if not Path(path).is_file():
        raise click.BadParameter(
            f"{path} is not a file; write it with `bench llama-cpp gguf`."
        )
    return label, Path(path)


def _built(build_dir: Path, cuda: bool, ik: bool = False) -> Path:
    """llama-bench of that variant, or an error that says how to build it."""
    from .llama_cpp import binary

    exe = binary(build_dir, "ik" if ik else "cuda" if cuda else "cpu")
    if not exe.is_file():
        raise FileNotFoundError(
            f"{exe} is missing; run `moestream bench llama-cpp build"
            + (" --ik`." if ik else " --cuda`." if cuda else "`.")
        )
    return exe


def _llama_gpu_options(fn: F) -> F:
    """--cuda and --ngl, as compare and beyond-ram both take them."""
    fn = click.option(
        "--ngl", type=int, default=None, help="llama.cpp -ngl (layers on the GPU)."
    )(fn)
    return click.option(
        "--cuda", is_flag=True, help="Run the CUDA build of llama-bench."
    )(fn)


@llama_group.command("compare", context_settings=CONTEXT)
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--gguf",
    "ggufs",
    multiple=True,
    required=True,
    metavar="[LABEL=]FILE",
    help="The same weights as GGUF (repeatable: e.g. q4_1=a.gguf q4_0=b.gguf).",
)
@click.option(
    "--ik-gguf",
    "ik_ggufs",
    multiple=True,
    metavar="[LABEL=]FILE",
    help="GGUF files for ik_llama.cpp rows too (`build --ik` first; repeatable).",
)
@click.option(
    "--budgets", default="100,25", show_default=True, help="moestream slots, %."
)
@click.option("--modes", default="warm", show_default=True, help="warm and/or cold.")
@click.option("--tokens", default=32, show_default=True, help="Decode tokens per run.")
@click.option(
    "--prompt-tokens", default=512, show_default=True, help="Prefill (0: none)."
)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True, help="llama.cpp threads.")
@_llama_gpu_options
@click.option(
    "--n-cpu-moe",
    type=int,
    multiple=True,
    help="llama.cpp -ncmoe N (repeatable: one set of llama.cpp rows each).",
)
@click.option(
    "--cpu-moe", is_flag=True, help="Every layer's experts on the CPU (-ncmoe all)."
)
@click.option(
    "--llama-arg",
    "llama_args",
    multiple=True,
    help="More llama-bench arguments, one per option, e.g. --llama-arg=--repack.",
)
@click.option(
    "--no-resident", is_flag=True, help="No mlx-lm row (a model larger than RAM)."
)
@click.option(
    "--compare",
    multiple=True,
    metavar="FIELD=VALUE[,...]",
    help="More moestream rows with these RuntimeConfig fields (repeatable), "
    "e.g. backend=mapped.",
)
@click.option(
    "--build-dir", type=click.Path(path_type=Path), default=BUILD, show_default=True
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def compare_cmd(
    model: Path,
    ggufs: tuple[str, ...],
    ik_ggufs: tuple[str, ...],
    budgets: str,
    modes: str,
    tokens: int,
    prompt_tokens: int,
    repeats: int,
    threads: int,
    ngl: int | None,
    n_cpu_moe: tuple[int, ...],
    cpu_moe: bool,
    llama_args: tuple[str, ...],
    cuda: bool,
    no_resident: bool,
    compare: tuple[str, ...],
    build_dir: Path,
    as_json: bool,
) -> None:
    """One table: llama.cpp, mlx-lm resident and moestream on MODEL's weights."""
    import json

    from .cli import _floats, parse_compare
    from .peer import PeerConfig, main

    def run() -> None:
        exe = _built(build_dir, cuda)
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        cfg = PeerConfig(
            out=model,
            ggufs=tuple(_gguf_option(g) for g in ggufs),
            exe=exe,
            ik_ggufs=tuple(_gguf_option(g) for g in ik_ggufs),
            ik_exe=_built(build_dir, False, ik=True) if ik_ggufs else None,
            budgets=_floats(budgets),
            modes=tuple(m.strip() for m in modes.split(",")),
            decode_tokens=tokens,
            prompt_tokens=prompt_tokens,
            repeats=repeats,
            threads=threads,
            ngl=ngl,
            n_cpu_moe=(*n_cpu_moe, *([layers] if cpu_moe else [])) or (None,),
            llama_extra=llama_args,
            resident=not no_resident,
            compare=tuple(parse_compare(c) for c in compare),
        )
        main(cfg, as_json)

    user_errors(run)


@click.command(context_settings=CONTEXT)
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--gguf",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The same weights as GGUF (`bench llama-cpp gguf`); without it, "
    "moestream's rows only.",
)
@click.option(
    "--budgets", default="25,50", show_default=True, help="moestream slots, %."
)
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A routing trace (.npz) moestream's MoE blocks route by (prefetch from "
    "its recorded predictions, or off).",
)
@click.option("--tokens", default=128, show_default=True, help="Decode tokens per run.")
@click.option("--repeats", default=1, show_default=True)
@click.option("--threads", default=2, show_default=True, help="llama.cpp threads.")
@click.option(
    "--floor",
    default="4G",
    show_default=True,
    help="MemAvailable the balloon holds the machine at (never under 4G).",
)
@click.option(
    "--compare",
    multiple=True,
    metavar="FIELD=VALUE[,...]",
    help="More moestream rows with these RuntimeConfig fields (repeatable).",
)
@click.option("--llama-arg", "llama_args", multiple=True, help="More llama-bench args.")
@_llama_gpu_options
@click.option("--n-cpu-moe", type=int, default=None, help="llama.cpp -ncmoe N.")
@click.option(
    "--no-in-ram",
    is_flag=True,
    help="Skip the in-RAM rows (a model whose experts do not all fit in RAM); "
    "the roofline is then the disk's alone.",
)
@click.option(
    "--compute-experts",
    type=click.IntRange(min=1),
    default=None,
    help="For a model whose experts do not all fit in RAM: measure the compute "
    "term with each layer's first N experts in slots, every token routed "
    "uniformly among them (the same arithmetic per token).",
)
@click.option(
    "--no-balloon",
    is_flag=True,
    help="No balloon: for a model larger than the machine's whole RAM.",
)
@click.option(
    "--build-dir", type=click.Path(path_type=Path), default=BUILD, show_default=True
)
@click.option("--json", "as_json", is_flag=True)
@common_options
def beyond_cmd(
    model: Path,
    gguf: Path | None,
    budgets: str,
    trace: Path | None,
    tokens: int,
    repeats: int,
    threads: int,
    floor: str,
    compare: tuple[str, ...],
    llama_args: tuple[str, ...],
    cuda: bool,
    ngl: int | None,
    n_cpu_moe: int | None,
    no_in_ram: bool,
    compute_experts: int | None,
    no_balloon: bool,
    build_dir: Path,
    as_json: bool,
) -> None:
    """MODEL larger than the RAM left to it: a balloon holds the rest; moestream
    and llama.cpp's mmap, cold and warm, against the disk's measured limit."""
    from ..units import parse_size
    from .beyond import BeyondConfig, main
    from .cli import _floats, parse_compare

    def run() -> None:
        cfg = BeyondConfig(
            out=model,
            gguf=gguf,
            exe=_built(build_dir, cuda) if gguf else None,
            budgets=_floats(budgets),
            decode_tokens=tokens,
            repeats=repeats,
            threads=threads,
            floor=max(parse_size(floor), 4 << 30),
            llama_extra=llama_args,
            ngl=ngl,
            n_cpu_moe=n_cpu_moe,
            runtime_fields=tuple(parse_compare(c) for c in compare),
            trace=trace,
            in_ram=not no_in_ram,
            compute_experts=compute_experts,
            balloon=not no_balloon,
        )
        main(cfg, as_json)

    user_errors(run)
