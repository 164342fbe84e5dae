"""Run a Python script or module with slotpool installed as PyTorch's CUDA allocator.

    python -m slotpool_torch [--backend B] [--conf C] [-v] script.py [args...]
    python -m slotpool_torch [options] -m module [args...]
    python -m slotpool_torch --build        (build or load the extension, say where, exit)

Needs torch only to run something: --help works without it, and a missing torch, CUDA toolkit or
libslotpool is reported in one line (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


# Options that take a value: what follows them is not the script.
_VALUED = ("--backend", "--conf")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slotpool_torch",
        usage="%(prog)s [options] script.py [args...]\n"
        "       %(prog)s [options] -m module [args...]\n"
        "       %(prog)s --build",
        description="Run a Python script or module with slotpool (a CUDA caching allocator) as "
        "PyTorch's CUDA allocator. Everything after the script (or -m MODULE) goes to it.",
        epilog="Environment: SLOTPOOL_CONF (configuration beneath --conf), SLOTPOOL_BACKEND, "
        "SLOTPOOL_LOG (e.g. info), SLOTPOOL_LIB (libslotpool.so or its directory). "
        "Guide: docs/torch.md.",
    )
    p.add_argument("--backend", default="cuda",
                   help="slotpool's backend: cuda (default), sim (no GPU, tests) or auto")
    p.add_argument("--conf", default=None,
                   help='slotpool configuration, "key:value,..." over $SLOTPOOL_CONF '
                   '(e.g. "growth:classic,max_split_size_mb:256")')
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say how the extension was found or built")
    p.add_argument("--build", action="store_true",
                   help="build or load the extension, print where it is, and exit")
    p.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a library module as a script (the rest of the line is its arguments)")
    return p


def _split(argv: list[str]) -> tuple[list[str], str | None, list[str] | None]:
    """(our options, the -m module or None, what goes to the script or module; None: nothing
    named). Our options end at the first argument that is not one, at `--`, or after -m MODULE."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _VALUED:
            i += 2
        elif a == "-m":
            if i + 1 >= len(argv):
                return argv, None, None  # argparse reports the missing MODULE
            return argv[:i], argv[i + 1], argv[i + 2:]
        elif a == "--":
            return argv[:i], None, argv[i + 1:]
        elif a.startswith("-"):
            i += 1
        else:
            return argv[:i], None, argv[i:]
    return argv, None, None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Our options, with `module` (-m) and `target`: the script and its arguments, or the
    module's arguments."""
    p = parser()
    ours, module, rest = _split(argv)
    args = p.parse_args(ours)
    if module is not None:
        args.module = module
    args.target = rest or []
    if args.conf is not None and not args.conf.strip():
        args.conf = None
    if not args.build and args.module is None and not args.target:
        p.error("a script or -m MODULE is required (or --build)")
    return args


def _fail(e: BaseException) -> None:
    print(f"slotpool_torch: error: {e}", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import slotpool_torch

    try:
        if args.build:
            ext = slotpool_torch.load(verbose=True)
            print(f"extension: {getattr(ext, '__file__', '?')}")
            print(f"built for torch {ext.built_for_torch()} (running {slotpool_torch.torch.__version__})")
            print(f"libslotpool: {slotpool_torch._loader.lib_path()}")
            print(f"slotpool version {ext.slotpool_version()}, header {ext.header_version()}")
            return
        slotpool_torch.install(backend=args.backend, conf=args.conf, verbose=args.verbose)
    except (ImportError, OSError, RuntimeError) as e:
        _fail(e)

    if args.module is not None:
        sys.argv = [args.module] + args.target
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script = args.target[0]
        if not os.path.isfile(script):
            _fail(FileNotFoundError(f"no such script: {script}"))
        sys.argv = args.target
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
