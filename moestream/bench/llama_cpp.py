"""llama.cpp as a benchmark peer: its source from PyPI, built once, run on GGUF.

The `llama-cpp-python` source distribution carries llama.cpp's whole source
(vendor/llama.cpp, with convert_hf_to_gguf.py and gguf-py), so nothing but
PyPI is needed. `prepare_source` downloads and unpacks it once; `pack_source`
writes a trimmed copy small enough to carry to a machine without network;
`build` compiles `llama-bench` once per variant (cpu: -DGGML_NATIVE=ON;
cuda: -DGGML_CUDA=ON, sm_90; ik: ik_llama.cpp, the CPU fork, from the
`ik-llama-cpp-python` source distribution); `run_llama_bench` runs it in a
fresh process and measures what llama-bench does not report itself (peak
RSS, bytes read from disk). On a CPU with AMX the CPU builds leave AMX out
(llama.cpp's AMX path dies on its tile instructions in prefill there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from .sysio import drop_cache, read_bytes


class ToolError(OSError):
    """pip, CMake or llama-bench failed (the message says which, and its last error)."""


PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SOURCE_DIR = "llama.cpp-src"  # under the build directory
PACKED = f"llama.cpp-{VERSION}-src.tar.gz"  # trimmed source, to carry
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# Not needed to build llama-bench or write GGUF (vocab files, docs, other tools).
SKIP = (
    "models/",
    "docs/",
    "media/",
    "tools/server/",
    "tools/ui/",
    "examples/",
    "tests/",
    "benches/",
    "pocs/",
    "app/",
    "ggml/src/ggml-vulkan/",
    "ggml/src/ggml-sycl/",
    "ggml/src/ggml-metal/",
    "ggml/src/ggml-opencl/",
    "ggml/src/ggml-hexagon/",
)
# ik_llama.cpp: its sdist lacks the script that writes common/build-info.cpp
IK_PACKAGE = "ik-llama-cpp-python"
IK_VERSION = "0.1.5"
IK_SDIST = f"ik_llama_cpp_python-{IK_VERSION}.tar.gz"
IK_SOURCE_DIR = "ik_llama.cpp-src"
IK_VENDOR = f"ik_llama_cpp_python-{IK_VERSION}/vendor/ik_llama.cpp/"
BUILD_INFO_GEN = """\
include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in
               ${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)
"""
VARIANTS = {
    "cpu": ["-DGGML_NATIVE=ON"],
    # llama-bench is one of ik_llama.cpp's examples
    "ik": ["-DGGML_NATIVE=ON", "-DLLAMA_BUILD_EXAMPLES=ON"],
    # native CPU code too: with --cpu-moe / --n-cpu-moe the experts run on the
    # host's CPU, built where it runs
    "cuda": ["-DGGML_NATIVE=ON", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"],
}
COMMON_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
]


# On a CPU with AMX: -march=native's ISA less AMX, as ggml's own options.
ISA_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def native_options(flags: set[str]) -> list[str]:
    """-DGGML_NATIVE=ON, or on a CPU with AMX the same ISA with AMX off."""
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    isa = [f"-D{o}={'ON' if f in flags else 'OFF'}" for f, o in ISA_OPTIONS.items()]
    amx = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return ["-DGGML_NATIVE=OFF", *isa, *amx]


def prepare_ik_source(build: Path) -> Path:
    """build/ik_llama.cpp-src from ik-llama-cpp-python's sdist (downloaded
    once), with the build-info script it lacks."""
    src = build / IK_SOURCE_DIR
    if not (src / "CMakeLists.txt").is_file():
        sdist = download_sdist(build / "dl", IK_PACKAGE, IK_VERSION, IK_SDIST)
        _unpack(sdist, IK_VENDOR, build, src)
    gen = src / "common" / "cmake" / "build-info-gen-cpp.cmake"
    if not gen.is_file():
        gen.parent.mkdir(parents=True, exist_ok=True)
        gen.write_text(BUILD_INFO_GEN)
    return src


def _unpack(sdist: Path, vendor: str, build: Path, src: Path) -> None:
    """The sdist's `vendor` folder as `src` (through a temp name)."""
    tmp = build / f".{src.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(vendor)]
        for m in members:
            m.name = m.name[len(vendor) :]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    tmp.rename(src)


def prepare_source(build: Path) -> Path:
    """build/llama.cpp-src: unpacked from a carried trimmed copy if there is
    one, else from the sdist (downloaded from PyPI once)."""
    src = build / SOURCE_DIR
    if (src / "CMakeLists.txt").is_file():
        return src
    build.mkdir(parents=True, exist_ok=True)
    tmp = build / f".{SOURCE_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if (build / PACKED).is_file():
        with tarfile.open(build / PACKED) as tar:
            tar.extractall(tmp, filter="data")
    else:
        shutil.rmtree(tmp)
        _unpack(download_sdist(build / "dl"), VENDOR, build, src)
        return src
    tmp.rename(src)
    return src


def download_sdist(
    dest: Path, package: str = PACKAGE, version: str = VERSION, sdist: str = SDIST
) -> Path:
    """A source distribution from PyPI (pip download): llama-cpp-python's."""
    path = dest / sdist
    if path.is_file():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        package,
        f"{package}=={version}",
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.is_file():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ToolError(f"pip download of {package}=={version} failed: {tail}")
    return path


def pack_source(build: Path) -> Path:
    """build/llama.cpp-<version>-src.tar.gz: the source without what llama-bench
    and gguf-py do not need (~10x smaller than the sdist), to carry."""
    src = prepare_source(build)
    out = build / PACKED
    tmp = out.with_name(f".{out.name}.tmp")

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name + ("/" if info.isdir() else "")
        return None if rel.startswith(SKIP) else info

    with tarfile.open(tmp, "w:gz") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)
    os.replace(tmp, out)
    return out


def binary(build: Path, variant: str) -> Path:
    if variant == "ik":
        return build / "ik_llama.cpp-cpu" / "bin" / "llama-bench"
    return build / f"llama.cpp-{variant}" / "bin" / "llama-bench"


def configure_options(variant: str, flags: set[str]) -> list[str]:
    """CMake's -D options for a variant on a CPU with these feature flags.
    ik_llama.cpp has no AMX path, and its ISA options without -march=native
    leave out AVX-512 VL and DQ, which its AVX-512 code needs: it is built
    -DGGML_NATIVE=ON everywhere."""
    common = [f for f in COMMON_FLAGS if variant != "ik" or "EXAMPLES" not in f]
    options = []
    for o in VARIANTS[variant]:
        native = o == "-DGGML_NATIVE=ON" and variant != "ik"
        options += native_options(flags) if native else [o]
    return [*common, *options]


def build_llama(build: Path, variant: str = "cpu", jobs: int | None = None) -> Path:
    """Configure and compile llama-bench once into build/llama.cpp-<variant>/."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}.")
    exe = binary(build, variant)
    if exe.is_file():
        return exe
    for tool in ("cmake",) + (("nvcc",) if variant == "cuda" else ()):
        if shutil.which(tool) is None:
            raise ToolError(
                f"{tool} is not on PATH; it is needed to build llama.cpp ({variant})."
            )
    src = prepare_ik_source(build) if variant == "ik" else prepare_source(build)
    tree = exe.parent.parent / "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _check(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(tree),
            *gen,
            *configure_options(variant, cpu_flags()),
        ]
    )
    _check(
        [
            "cmake",
            "--build",
            str(tree),
            "--target",
            "llama-bench",
            "-j",
            str(jobs or os.cpu_count() or 2),
        ]
    )
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tree / "bin" / "llama-bench", exe)
    return exe


def _last_error(output: str) -> str | None:
    """A tool's last line that says "error", else its last line (None: silent)."""
    lines = [x.strip() for x in output.strip().splitlines()]
    errors = [x for x in lines if "error" in x.lower()] or lines
    return errors[-1] if errors else None


def _check(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        error = _last_error(proc.stdout + proc.stderr) or proc.returncode
        raise ToolError(f"{' '.join(cmd[:3])} failed: {error}")


@dataclass(frozen=True)
class LlamaJob:
    """One llama-bench process: a decode (tg) or a prefill (pp) test."""

    exe: str
    gguf: str
    prompt_tokens: int = 0  # pp test when > 0
    decode_tokens: int = 0  # tg test when > 0
    threads: int = 2
    repeats: int = 1
    cold: bool = False  # drop the GGUF from the page cache first, no warm-up run
    ngl: int | None = None  # -ngl: layers on the GPU
    n_cpu_moe: int | None = None  # -ncmoe: layers whose experts stay on the CPU
    extra: tuple[str, ...] = ()  # more llama-bench flags, e.g. ("--repack", "0")

    def argv(self) -> list[str]:
        cmd = [
            self.exe,
            "-m",
            self.gguf,
            "-p",
            str(self.prompt_tokens),
            "-n",
            str(self.decode_tokens),
            "-t",
            str(self.threads),
            "-r",
            str(self.repeats),
            "-o",
            "json",
        ]
        if self.cold:
            cmd.append("--no-warmup")
        if self.ngl is not None:
            cmd += ["-ngl", str(self.ngl)]
        if self.n_cpu_moe is not None:
            cmd += ["-ncmoe", str(self.n_cpu_moe)]
        return cmd + list(self.extra)


def run_llama_bench(job: LlamaJob) -> dict:
    """Run llama-bench once: its tok/s, plus peak RSS and disk bytes measured here."""
    if job.cold:
        drop_cache(Path(job.gguf))
    before = read_bytes()
    with _TempText() as out, _TempText() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(job.argv(), stdout=out.file, stderr=err.file)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        text = out.read()
        if proc.returncode != 0:
            raise ToolError(_failure(job, proc.returncode, err.read()))
    tests = json.loads(text)
    test = tests[0]
    tokens = (job.prompt_tokens + job.decode_tokens) * job.repeats
    if not job.cold:
        tokens += job.prompt_tokens + job.decode_tokens  # the warm-up run
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {
        "tps": float(test["avg_ts"]),
        "samples_tps": [float(x) for x in test.get("samples_ts", [])],
        "seconds": float(test["avg_ns"]) / 1e9,
        "peak_rss": rss,
        "disk_bytes_per_token": (read_bytes() - before) / max(tokens, 1),
        "wall_s": wall,
        "n_prompt": test.get("n_prompt"),
        "n_gen": test.get("n_gen"),
        "type_k": test.get("type_k"),
        "model_size": test.get("model_size"),
        "backends": test.get("backends"),
    }


def _failure(job: LlamaJob, code: int, stderr: str) -> str:
    """llama-bench's exit: its last error line, its command, and what to do
    where that is known."""
    error = _last_error(stderr) or "(no output)"
    message = f"llama-bench failed ({code}): {error}"
    if "CPU_REPACK" in stderr:
        message += (
            " (llama.cpp repacks this GGUF's weights into memory of its own, "
            "which a model larger than RAM cannot have: pass "
            "--llama-arg=--repack --llama-arg=0 to read them mapped)"
        )
    return f"{message}; command: {' '.join(job.argv())}"


class _TempText:
    """A temp file for a child's stdout (read after the child is reaped)."""

    def __enter__(self) -> _TempText:
        import tempfile

        self.file = tempfile.TemporaryFile()
        return self

    def read(self) -> str:
        self.file.seek(0)
        return self.file.read().decode()

    def __exit__(self, *exc: object) -> None:
        self.file.close()
