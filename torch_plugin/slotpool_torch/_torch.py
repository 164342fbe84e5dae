"""PyTorch, imported on first use: ``from ._torch import torch`` gives a stand-in that imports the
real module the first time an attribute is read. So ``import slotpool_torch`` and
``python -m slotpool_torch --help`` work where torch is not installed, and the first call that
needs it raises :class:`TorchMissing` with a message that says what to do, not a traceback from
deep inside the package."""

from __future__ import annotations

import importlib

INSTALL_HINT = (
    "slotpool_torch needs PyTorch (torch 2.11 with CUDA), which is not installed in this Python "
    "({python}). Install it first (https://pytorch.org/get-started/locally/), then "
    "`pip install --no-build-isolation ./torch_plugin`."
)


class TorchMissing(ImportError):
    """torch cannot be imported."""


def require_torch():
    """The torch module, or :class:`TorchMissing` if it cannot be imported."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        import sys

        why = "" if getattr(e, "name", None) == "torch" else f" (importing it failed: {e})"
        raise TorchMissing(INSTALL_HINT.format(python=sys.executable) + why) from None


def have_torch() -> bool:
    """Whether torch can be imported (imports it)."""
    try:
        require_torch()
    except TorchMissing:
        return False
    return True


class _LazyTorch:
    """Stands in for the torch module until an attribute is read."""

    def __getattr__(self, name: str):
        return getattr(require_torch(), name)

    def __repr__(self) -> str:
        return "<torch, imported on first use by slotpool_torch>"


torch = _LazyTorch()
