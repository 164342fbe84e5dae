"""The extension's C++ sources (no torch, no GPU): every one is built, each has its place in the
header's file map, none grows past the size the project keeps files under."""

import os
import re

from conftest import PLUGIN

from slotpool_torch import _loader


def test_every_csrc_source_is_built_and_named_in_the_header():
    # setup.py and the just-in-time build both compile _loader.SOURCES: a .cpp left out of it
    # would be missing from the extension (an undefined symbol at import, on the GPU machine).
    csrc = os.path.join(PLUGIN, "csrc")
    on_disk = sorted(f for f in os.listdir(csrc) if f.endswith(".cpp"))
    assert sorted(_loader.SOURCES) == on_disk
    assert len(set(_loader.SOURCES)) == len(_loader.SOURCES)
    assert _loader.SOURCES[-1] == "module.cpp" and "module.cpp" not in _loader.ALLOCATOR_SOURCES
    header = open(os.path.join(csrc, "slotpool_allocator.h")).read()
    for f in on_disk:
        assert re.search(rf"^//\s+{re.escape(f)}\s", header, re.M), f"{f} not in the header's file map"


def test_no_csrc_file_is_near_the_size_limit():
    csrc = os.path.join(PLUGIN, "csrc")
    for f in os.listdir(csrc):
        n = sum(1 for _ in open(os.path.join(csrc, f)))
        assert n < 700, f"{f}: {n} lines"
