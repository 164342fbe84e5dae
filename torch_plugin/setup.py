"""Build and install slotpool_torch against the installed torch.

    cargo build --release -p slotpool-capi          # libslotpool.so (or set SLOTPOOL_LIB)
    pip install --no-build-isolation ./torch_plugin

--no-build-isolation is needed: the extension must be compiled against the torch you run (pip's
isolated build environment would fetch another one). Environment:
  SLOTPOOL_LIB       libslotpool.so or its directory (default: ../target/release)
  SLOTPOOL_INCLUDE   directory of slotpool.h (default: ../include)
libslotpool.so is copied next to the extension (rpath $ORIGIN), so the installed package does not
depend on the source tree.
"""

import os
import shutil
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _lib() -> str:
    env = os.environ.get("SLOTPOOL_LIB")
    if env:
        path = env if os.path.isfile(env) else os.path.join(env, "libslotpool.so")
    else:
        path = os.path.join(REPO, "target", "release", "libslotpool.so")
    if not os.path.isfile(path):
        raise SystemExit(f"slotpool_torch: {path} not found; build it (cargo build --release -p slotpool-capi) or set SLOTPOOL_LIB")
    return os.path.abspath(path)


def _include() -> str:
    d = os.environ.get("SLOTPOOL_INCLUDE") or os.path.join(REPO, "include")
    if not os.path.isfile(os.path.join(d, "slotpool.h")):
        raise SystemExit(f"slotpool_torch: slotpool.h not found in {d}; set SLOTPOOL_INCLUDE")
    return os.path.abspath(d)


LIB = _lib()
LIBDIR = os.path.dirname(LIB)


class Build(BuildExtension):
    """BuildExtension that also puts libslotpool.so next to the built extension."""

    def run(self):
        super().run()
        for ext in self.extensions:
            dest = os.path.dirname(self.get_ext_fullpath(ext.name))
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(LIB, os.path.join(dest, "libslotpool.so"))


# Without the CUDA arch list set, cpp_extension queries the GPUs for arch flags; they only matter
# for .cu sources (there are none) and the query needs a GPU.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

setup(
    name="slotpool_torch",
    version="0.1.0",
    description="slotpool (a CUDA caching allocator) beneath PyTorch",
    packages=["slotpool_torch"],
    ext_modules=[
        CUDAExtension(
            name="slotpool_torch._C",
            sources=["csrc/slotpool_allocator.cpp", "csrc/module.cpp"],
            include_dirs=[_include(), os.path.join(HERE, "csrc")],
            library_dirs=[LIBDIR],
            libraries=["slotpool"],
            define_macros=[("SLOTPOOL_TORCH_VERSION_STR", torch.__version__)],
            extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"], "nvcc": []},
            # the process's shared libstdc++, never a static copy (see _loader.SHARED_LIBSTDCXX)
            extra_link_args=["-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{LIBDIR}"]
            + (["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []),
        )
    ],
    cmdclass={"build_ext": Build},
    python_requires=">=3.9",
    zip_safe=False,
)
