"""Builds moestream's native engine (csrc/, an MLX extension) with CMake.

On macOS nothing is compiled: the Python engine is the default there, and no
Metal code ships that could not be built and run here.
"""

import os
import shutil
import sys

from setuptools import setup

if sys.platform == "darwin":
    setup()
else:
    from mlx import extension

    class BuildNative(extension.CMakeBuild):
        def build_extension(self, ext: extension.CMakeExtension) -> None:
            if not (shutil.which("c++") or shutil.which("g++")):
                raise SystemExit(
                    "moestream: no C++ compiler found to build the native engine; "
                    "install one (Debian/Ubuntu: apt install g++) and run pip again."
                )
            import mlx.core as mx

            if mx.cuda.is_available() and shutil.which("nvcc"):
                args = os.environ.get("CMAKE_ARGS", "")
                os.environ["CMAKE_ARGS"] = f"{args} -DMOESTREAM_CUDA=ON".strip()
            super().build_extension(ext)

    setup(
        ext_modules=[extension.CMakeExtension("moestream._native", sourcedir="csrc")],
        cmdclass={"build_ext": BuildNative},
    )
