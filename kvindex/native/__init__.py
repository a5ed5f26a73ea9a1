"""The compiled hot path (``_native.pyx``, built by ``make install``): the block-key chain and the
in-memory index's maps, which ``kvindex.keys`` and ``kvindex.memory`` use when it loads. It imports
nothing of the project.

``module`` is the compiled module, or ``None`` with ``reason`` saying why: not built (run ``make
install``), or turned off with ``KVCACHE_NATIVE=0`` (the pure-Python versions, which the same tests
run against, then do the work)."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

module: ModuleType | None = None
reason = ""

if os.environ.get("KVCACHE_NATIVE", "1").strip().lower() in {"0", "false", "no", "off"}:
    reason = "turned off by KVCACHE_NATIVE"
else:
    try:
        module = importlib.import_module("kvindex.native._native")
    except ImportError as error:
        reason = f"not built ({error}): run make install"
        logging.getLogger(__name__).warning("the compiled hot path is not loaded: %s", reason)
