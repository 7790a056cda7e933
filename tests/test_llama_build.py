"""How the bench configures llama.cpp and ik_llama.cpp (no compiler run)."""

from __future__ import annotations

from pathlib import Path

from moestream.bench import llama_cpp


def test_amx_is_left_out_where_the_cpu_has_it():
    assert llama_cpp.native_options({"avx2", "avx512f"}) == ["-DGGML_NATIVE=ON"]
    options = llama_cpp.native_options({"avx2", "fma", "avx512f", "amx_tile"})
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_AMX_INT8=OFF" in options
    assert "-DGGML_AVX512=ON" in options and "-DGGML_AVX512_BF16=OFF" in options


def test_ik_is_built_native_even_where_the_cpu_has_amx():
    """ik_llama.cpp has no AMX path; its ISA options alone miss AVX-512 VL/DQ."""
    ik = llama_cpp.configure_options("ik", {"avx2", "avx512f", "amx_tile"})
    assert "-DGGML_NATIVE=ON" in ik and "-DGGML_NATIVE=OFF" not in ik
    cpu = llama_cpp.configure_options("cpu", {"avx2", "avx512f", "amx_tile"})
    assert "-DGGML_NATIVE=OFF" in cpu and "-DGGML_AMX_TILE=OFF" in cpu


def test_ik_builds_llama_bench_among_its_examples():
    ik = llama_cpp.configure_options("ik", {"avx2"})
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in ik and "-DLLAMA_BUILD_EXAMPLES=OFF" not in ik
    cpu = llama_cpp.configure_options("cpu", {"avx2"})
    assert "-DLLAMA_BUILD_EXAMPLES=OFF" in cpu and "-DGGML_NATIVE=ON" in cpu
    assert llama_cpp.binary(Path("b"), "ik") == Path(
        "b/ik_llama.cpp-cpu/bin/llama-bench"
    )


def test_ik_source_gets_the_build_info_script_it_lacks(tmp_path: Path):
    src = tmp_path / llama_cpp.IK_SOURCE_DIR
    (src / "common").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    assert llama_cpp.prepare_ik_source(tmp_path) == src
    gen = src / "common" / "cmake" / "build-info-gen-cpp.cmake"
    assert "configure_file" in gen.read_text()
