"""One adapter per transformers architecture, one module each (`base.py` holds what they share). The registry is
this package's modules: every module that defines `ADAPTER` is an architecture the bridge loads, so adding one is
adding its module (docs/adding_a_family.md)."""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from pathlib import Path

from recurscope.interp.bridge.adapters.base import BridgeAdapter

__all__ = ["BridgeAdapter", "adapters"]


@lru_cache(maxsize=None)
def adapters() -> tuple[BridgeAdapter, ...]:
    """Every architecture's adapter, in their `order`."""
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):   # this package's modules
        module = importlib.import_module(f"{__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if isinstance(adapter, BridgeAdapter):
            found.append(adapter)
    return tuple(sorted(found, key=lambda a: (a.order, a.spec.name)))
