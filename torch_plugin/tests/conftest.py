"""pytest setup of slotpool_torch's tests.

    pytest torch_plugin/tests           # everything that can run here
    pytest torch_plugin/tests -m cuda   # only the PyTorch-on-GPU checks

Tests marked `cuda` need torch and a CUDA device and are skipped without them; the rest run
anywhere (no torch needed). The package is taken from this checkout unless one is installed.
SLOTPOOL_TORCH_TEST_ALLOCATOR=native runs the PyTorch checks under PyTorch's own allocator, as a
control (slotpool's own API checks are skipped then).
"""

import importlib.util
import os
import sys

import pytest

PLUGIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PLUGIN)
if importlib.util.find_spec("slotpool_torch") is None:
    sys.path.insert(0, PLUGIN)


def cuda_or_skip():
    """torch, once a CUDA device is known to exist (without initialising CUDA); else skip."""
    from slotpool_torch._torch import TorchMissing, require_torch

    try:
        torch = require_torch()
    except TorchMissing:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.fixture(scope="session")
def allocator():
    """slotpool_torch installed as PyTorch's CUDA allocator for the whole test run (None under
    the native control). Must run before anything initialises CUDA."""
    torch = cuda_or_skip()
    if os.environ.get("SLOTPOOL_TORCH_TEST_ALLOCATOR", "slotpool") == "native":
        return None
    import slotpool_torch

    if not slotpool_torch.is_installed() and torch.cuda.is_initialized():
        pytest.fail("CUDA was initialised before slotpool_torch.install(); run the cuda tests in "
                    "their own process")
    slotpool_torch.install(conf=os.environ.get("SLOTPOOL_TORCH_CONF"))
    return slotpool_torch
