"""Build memprof and its native capture core, memprof._C.

CUDAExtension when torch is a CUDA build and a CUDA toolkit is found (CUDA_HOME);
CppExtension otherwise. The choice does not depend on a GPU being present.
"""

from __future__ import annotations

import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:  # pragma: no cover - build-time message
    sys.exit(f"memprof: building needs torch importable ({exc}); install torch first, "
             "then: pip install --no-build-isolation -e .")

SOURCES = ["csrc/events.cpp", "csrc/capture.cpp", "csrc/signals.cpp", "csrc/grads.cpp", "csrc/maxflow.cpp",
           "csrc/bindings.cpp"]
# The C++ standard is torch's choice (-std=c++17 on torch 2.11, c++20 on 2.13); the code builds with both.
CXX_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]

with_cuda = bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None
if with_cuda:
    ext = cpp_extension.CUDAExtension(
        "memprof._C", SOURCES, define_macros=[("MEMPROF_WITH_CUDA", "1")],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": []},
    )
else:
    ext = cpp_extension.CppExtension("memprof._C", SOURCES, extra_compile_args=CXX_FLAGS)
print(f"memprof: building memprof._C as {'CUDAExtension' if with_cuda else 'CppExtension'} "
      f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
      f"CUDA_HOME {cpp_extension.CUDA_HOME or 'not found'})", file=sys.stderr)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
