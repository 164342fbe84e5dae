"""The C++ extension of slotpool_torch (metadata: pyproject.toml).

    cargo build --release -p slotpool-capi          # libslotpool.so (or set SLOTPOOL_LIB)
    pip install --no-build-isolation ./torch_plugin

--no-build-isolation is needed: the extension must be compiled against the torch you run (pip's
isolated build environment would fetch another one). Environment:
  SLOTPOOL_LIB       libslotpool.so(.0) or its directory (default: ../target/release; an
                     installed prefix's lib/ works too)
  SLOTPOOL_INCLUDE   directory of slotpool.h (default: ../include)
libslotpool.so.0 is copied next to the extension (rpath $ORIGIN), so the installed package does
not depend on the source tree. Without torch or a CUDA toolkit this says so and stops.
"""

import os
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from slotpool_torch._loader import LIB_NAMES, SOURCES, toolkit_problem  # noqa: E402 (needs no torch)
from slotpool_torch._torch import TorchMissing, require_torch  # noqa: E402


def _stop(message: str) -> None:
    sys.stderr.write(f"\nerror: {message}\n\n")
    raise SystemExit(1)


try:
    torch = require_torch()
except TorchMissing as e:
    _stop(str(e))
from torch.utils import cpp_extension  # noqa: E402

problem = toolkit_problem(cpp_extension.CUDA_HOME)
if problem:
    _stop(problem)


def _lib() -> str:
    env = os.environ.get("SLOTPOOL_LIB")
    where = env or os.path.join(REPO, "target", "release")
    paths = [where] if os.path.isfile(where) else [os.path.join(where, n) for n in LIB_NAMES]
    for path in paths:
        if os.path.isfile(path):
            return os.path.abspath(path)
    _stop(f"slotpool_torch: no {' or '.join(LIB_NAMES)} in {where}; build it (cargo build "
          "--release -p slotpool-capi) or set SLOTPOOL_LIB")


def _include() -> str:
    d = os.environ.get("SLOTPOOL_INCLUDE") or os.path.join(REPO, "include")
    if not os.path.isfile(os.path.join(d, "slotpool.h")):
        _stop(f"slotpool_torch: slotpool.h not found in {d}; set SLOTPOOL_INCLUDE")
    return os.path.abspath(d)


LIB = _lib()
LIBDIR = os.path.dirname(LIB)


class Build(cpp_extension.BuildExtension):
    """BuildExtension that also puts libslotpool.so.0 (the name the extension records) next to
    the built extension."""

    def run(self):
        super().run()
        for ext in self.extensions:
            dest = os.path.dirname(self.get_ext_fullpath(ext.name))
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(LIB, os.path.join(dest, LIB_NAMES[0]))


# Without the CUDA arch list set, cpp_extension queries the GPUs for arch flags; they only matter
# for .cu sources (there are none) and the query needs a GPU.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

setup(
    ext_modules=[
        cpp_extension.CUDAExtension(
            name="slotpool_torch._C",
            sources=[f"csrc/{s}" for s in SOURCES],
            include_dirs=[_include(), os.path.join(HERE, "csrc")],
            # By path: any of LIB_NAMES links; the extension records the SONAME either way.
            extra_objects=[LIB],
            define_macros=[("SLOTPOOL_TORCH_VERSION_STR", torch.__version__)],
            extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"], "nvcc": []},
            # the process's shared libstdc++, never a static copy (see _loader.SHARED_LIBSTDCXX)
            extra_link_args=["-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{LIBDIR}"]
            + (["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []),
        )
    ],
    cmdclass={"build_ext": Build},
    zip_safe=False,
)
