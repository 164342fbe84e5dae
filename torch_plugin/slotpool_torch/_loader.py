"""Finding libslotpool.so and loading (or building) the C++ extension.

Order:
  1. SLOTPOOL_TORCH_JIT=1: build from source with torch.utils.cpp_extension.load.
  2. The installed extension (``pip install --no-build-isolation ./torch_plugin``): ``slotpool_torch._C``.
  3. Otherwise, from a source checkout: build just in time into a cache directory keyed by the
     torch and Python versions (``SLOTPOOL_TORCH_BUILD_DIR`` overrides it).

The extension records ``torch.__version__`` at build time; loading it under another torch is
refused (PyTorch's allocator interface changes between versions).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import sys
import time

from ._torch import require_torch, torch  # imported on first use: finding the library needs no torch

PKG_DIR = os.path.dirname(os.path.abspath(__file__))
PLUGIN_DIR = os.path.dirname(PKG_DIR)  # torch_plugin/ in a source checkout
REPO_DIR = os.path.dirname(PLUGIN_DIR)
CSRC_DIR = os.path.join(PLUGIN_DIR, "csrc")
# The extension's C++ sources in csrc/, one concern each (csrc/slotpool_allocator.h lists them):
# the allocator's (also what scripts/torch_host_check.sh compiles without the Python bindings),
# then the bindings.
ALLOCATOR_SOURCES = (
    "allocator.cpp",
    "conf.cpp",
    "routes.cpp",
    "pools.cpp",
    "orphans.cpp",
    "checkpoints.cpp",
    "graph_state.cpp",
    "history.cpp",
    "snapshot.cpp",
    "ipc.cpp",
)
SOURCES = ALLOCATOR_SOURCES + ("module.cpp",)
# The C++ runtime must be the process's shared libstdc++, the one torch uses. A toolchain whose
# search path offers only libstdc++.a (the H200 image's /opt/gcc wrapper) would otherwise link a
# private static copy whose iostreams are never initialised (GCC 13 runs that initialiser from
# the library), and the first number formatted into a TORCH_CHECK message crashes.
SHARED_LIBSTDCXX = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []

REBUILD_HINT = (
    "Rebuild it against the torch you run: `pip install --no-build-isolation --force-reinstall "
    "./torch_plugin`, or from a source checkout set SLOTPOOL_TORCH_JIT=1 to build it just in time."
)

_lib_handle = None
_lib_path = None


# The library's names, in the order looked for in a directory: its SONAME (what an installed
# prefix and an installed package hold), then cargo's output name.
LIB_NAMES = ("libslotpool.so.0", "libslotpool.so")


def _lib_in(directory: str) -> str | None:
    for name in LIB_NAMES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def find_lib() -> str:
    """Path of libslotpool: $SLOTPOOL_LIB (the file or its directory), else next to this
    package, else ../../target/release of a source checkout."""
    env = os.environ.get("SLOTPOOL_LIB")
    if env:
        path = env if os.path.isfile(env) else (_lib_in(env) if os.path.isdir(env) else None)
        if path is None:
            raise FileNotFoundError(
                f"slotpool_torch: SLOTPOOL_LIB={env!r}: no {' or '.join(LIB_NAMES)} there"
            )
        return os.path.abspath(path)
    dirs = [PKG_DIR, os.path.join(REPO_DIR, "target", "release")]
    for d in dirs:
        path = _lib_in(d)
        if path is not None:
            return path
    raise FileNotFoundError(
        "slotpool_torch: libslotpool.so not found; build it (`cargo build --release -p "
        "slotpool-capi`), install it (`scripts/install.sh --prefix DIR`, then "
        "SLOTPOOL_LIB=DIR/lib) or set SLOTPOOL_LIB. Looked in: " + ", ".join(dirs)
    )


def find_include() -> str:
    """Directory holding slotpool.h: $SLOTPOOL_INCLUDE, else include/ of a source checkout."""
    env = os.environ.get("SLOTPOOL_INCLUDE")
    candidates = [env] if env else [os.path.join(REPO_DIR, "include")]
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "slotpool.h")):
            return os.path.abspath(d)
    raise FileNotFoundError(
        "slotpool_torch: slotpool.h not found (set SLOTPOOL_INCLUDE); looked in " + ", ".join(map(str, candidates))
    )


def preload_lib() -> str:
    """dlopen libslotpool.so with RTLD_GLOBAL, so the extension binds to this copy whatever its
    rpath says (the loader reuses an already loaded SONAME)."""
    global _lib_handle, _lib_path
    if _lib_handle is None:
        path = find_lib()
        _lib_handle = ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        _lib_path = path
    return _lib_path


def lib_path() -> str | None:
    return _lib_path


def _versions_match(built: str, running: str) -> bool:
    if built == running:
        return True
    # A build without the recorded local tag knows only major.minor.patch.
    if "+" not in built and running.split("+")[0] == built:
        return True
    return False


def check_version(mod, origin: str) -> None:
    built = mod.built_for_torch()
    running = torch.__version__
    if not _versions_match(built, running):
        raise RuntimeError(
            f"slotpool_torch: the extension at {origin} was built for torch {built}, but torch "
            f"{running} is running. {REBUILD_HINT}"
        )


def default_build_dir() -> str:
    env = os.environ.get("SLOTPOOL_TORCH_BUILD_DIR")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", torch.__version__)
    return os.path.join(cache, "slotpool_torch", f"torch-{tag}-py{sys.version_info[0]}{sys.version_info[1]}")


def toolkit_problem(cuda_home: str | None) -> str | None:
    """Why the extension cannot be compiled with the CUDA toolkit at `cuda_home` (what
    torch.utils.cpp_extension found: $CUDA_HOME, nvcc's directory or /usr/local/cuda), or None.
    Only CUDA's headers are needed (the sources are C++, no .cu)."""
    hint = (
        "set CUDA_HOME to a CUDA toolkit (the one torch was built for: torch.version.cuda), or "
        "install the prebuilt extension (`pip install --no-build-isolation ./torch_plugin` where a "
        "toolkit exists)"
    )
    if not cuda_home:
        return f"slotpool_torch: building the extension needs a CUDA toolkit and none was found; {hint}."
    header = os.path.join(cuda_home, "include", "cuda_runtime_api.h")
    if not os.path.isfile(header):
        return f"slotpool_torch: CUDA toolkit at {cuda_home} has no {header}; {hint}."
    return None


def build_jit(verbose: bool = False):
    """Build (or reuse) the extension with torch.utils.cpp_extension.load from torch_plugin/csrc."""
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import load

    if not all(os.path.isfile(os.path.join(CSRC_DIR, s)) for s in SOURCES):
        raise ImportError(
            f"slotpool_torch: no C++ sources at {CSRC_DIR} (not a source checkout) and no installed "
            "extension; install it with `pip install --no-build-isolation ./torch_plugin`."
        )
    problem = toolkit_problem(cpp_extension.CUDA_HOME)
    if problem:
        raise ImportError(problem)
    lib = preload_lib()
    libdir = os.path.dirname(lib)
    include = find_include()
    build_dir = default_build_dir()
    os.makedirs(build_dir, exist_ok=True)
    # with_cuda=True makes cpp_extension compute CUDA arch flags, which queries the GPUs and so
    # initialises CUDA unless TORCH_CUDA_ARCH_LIST is set; the flags only matter for .cu files
    # (there are none here), so pin it for the build and keep CUDA uninitialised for install().
    saved_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not saved_arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    t0 = time.time()
    try:
        mod = load(
            name="slotpool_torch_C",
            sources=[os.path.join(CSRC_DIR, s) for s in SOURCES],
            extra_cflags=[
                "-O2",
                # SLOTPOOL_TORCH_DEBUG=1: debug info, for addr2line on a crash report.
                *(["-g"] if os.environ.get("SLOTPOOL_TORCH_DEBUG") == "1" else []),
                # SLOTPOOL_TORCH_PHASES=1: set_checkpoint_pool_state times its steps (phases.h).
                *(["-DSLOTPOOL_TORCH_PHASES"] if os.environ.get("SLOTPOOL_TORCH_PHASES") == "1"
                  else []),
                "-fvisibility=hidden",
                f"-DSLOTPOOL_TORCH_VERSION_STR={torch.__version__}",
            ],
            extra_include_paths=[include, CSRC_DIR],
            # The library by path (either of LIB_NAMES); the extension records its SONAME.
            extra_ldflags=[lib, f"-Wl,-rpath,{libdir}", *SHARED_LIBSTDCXX],
            build_directory=build_dir,
            with_cuda=True,
            verbose=verbose,
        )
    finally:
        if not saved_arch:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    if verbose:
        print(f"slotpool_torch: extension ready in {time.time() - t0:.1f}s ({build_dir})", file=sys.stderr)
    check_version(mod, build_dir)
    return mod


def load_extension(verbose: bool = False):
    """The extension module (see the module docstring for the order)."""
    require_torch()
    if os.environ.get("SLOTPOOL_TORCH_JIT") == "1":
        return build_jit(verbose)
    installed = None
    try:
        spec = importlib.util.find_spec("slotpool_torch._C")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        preload_lib()
        try:
            installed = importlib.import_module("slotpool_torch._C")
        except ImportError as e:
            raise ImportError(
                f"slotpool_torch: the installed extension ({spec.origin}) does not load under torch "
                f"{torch.__version__}: {e}. {REBUILD_HINT}"
            ) from e
        check_version(installed, spec.origin or "slotpool_torch._C")
        return installed
    return build_jit(verbose)
