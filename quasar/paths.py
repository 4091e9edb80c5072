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


# the cache's kinds whose entries are folders Quasar writes whole (with a manifest)
ENTRY_KINDS = ("gguf", "w8a8", "w4a8")


def in_cache(path: str | Path) -> bool:
    """Whether ``path`` is (or lies in) an entry of one of the cache's ENTRY_KINDS folders, as
    given or with links resolved (a test's cache may link parts of another): what Quasar wrote
    there must carry a manifest. A user's own folder that happens to sit under the cache root
    is not an entry."""
    path, root = Path(path), cache_root()
    for p, r in ((path.absolute(), root.absolute()), (path.resolve(), root.resolve())):
        try:
            parts = p.relative_to(r).parts
        except ValueError:
            continue
        if len(parts) >= 2 and parts[0] in ENTRY_KINDS:
            return True
    return False
