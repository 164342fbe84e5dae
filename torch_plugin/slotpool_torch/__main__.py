"""Run a Python script or module with slotpool installed as PyTorch's CUDA allocator.

usage: python -m slotpool_torch [--backend B] [--conf C] [-v] script.py [args...]
       python -m slotpool_torch [options] -m module [args...]
       python -m slotpool_torch --build        (build/load the extension, print where, exit)
"""

import os
import runpy
import sys


def _usage(code: int) -> None:
    print(__doc__.strip(), file=sys.stderr if code else sys.stdout)
    sys.exit(code)


def main(argv: list[str]) -> None:
    backend = "cuda"
    conf = None
    verbose = False
    build_only = False
    module = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            _usage(0)
        elif a == "--backend" and i + 1 < len(argv):
            backend = argv[i + 1]
            i += 2
        elif a.startswith("--backend="):
            backend = a.split("=", 1)[1]
            i += 1
        elif a == "--conf" and i + 1 < len(argv):
            conf = argv[i + 1]
            i += 2
        elif a.startswith("--conf="):
            conf = a.split("=", 1)[1]
            i += 1
        elif a in ("-v", "--verbose"):
            verbose = True
            i += 1
        elif a == "--build":
            build_only = True
            i += 1
        elif a == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            i += 2
            break
        elif a == "--":
            i += 1
            break
        elif a.startswith("-"):
            print(f"slotpool_torch: unknown option {a}", file=sys.stderr)
            _usage(2)
        else:
            break
    rest = argv[i:]

    import slotpool_torch

    if build_only:
        ext = slotpool_torch.load(verbose=True)
        print(f"extension: {getattr(ext, '__file__', '?')}")
        print(f"built for torch {ext.built_for_torch()} (running {__import__('torch').__version__})")
        print(f"libslotpool: {slotpool_torch._loader.lib_path()}")
        print(f"slotpool version {ext.slotpool_version()}, header {ext.header_version()}")
        return
    if module is None and not rest:
        _usage(2)

    slotpool_torch.install(backend=backend, conf=conf, verbose=verbose)
    if module is not None:
        sys.argv = [module] + rest
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = rest[0]
        sys.argv = rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
