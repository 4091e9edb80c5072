"""Where Quasar keeps what it builds once and reuses: the cache root and its parts.

Everything derived from a model (its float conversion from GGUF, W8A8 copies, peers'
exports) and the compiled C++ extension live under ``$QUASAR_CACHE`` (default
``~/.cache/quasar``), one sub-folder per kind, each entry keyed by what it was built from.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$QUASAR_CACHE``, else ``~/.cache/quasar`` (read on every call, so tests can redirect it)."""
    return Path(os.environ.get("QUASAR_CACHE") or Path.home() / ".cache" / "quasar")


def cache_dir(kind: str) -> Path:
    """The cache folder for one kind of entry, e.g. ``cache_dir("w8a8")``."""
    return cache_root() / kind


def in_cache(path: str | Path) -> bool:
    """Whether ``path`` lies under the cache root, as given or with links resolved (a test's
    cache may link parts of another): what Quasar wrote there must carry a manifest."""
    path, root = Path(path), cache_root()
    return any(p == r or r in p.parents for p, r in ((path.absolute(), root.absolute()),
                                                      (path.resolve(), root.resolve())))
