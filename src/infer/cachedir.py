"""infer's on-disk caches: where they live and how a file is written so that no reader ever sees half of it.

Everything infer caches sits under ``$XDG_CACHE_HOME/infer`` (default ``~/.cache/infer``): kernels/ (the C++
build), inductor/ (torch's compile caches), tokenizers/ (GGUF tokenizers converted), gguf/ (GGUF indexes),
profiles/ (the cost model's profiles). Each entry is keyed by what it was built from, so a stale one is never read as
current; a damaged one is reported and rebuilt by its owner.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/infer/<name>`` (not created)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "infer" / name


def write_atomic(path: Path, text: str) -> bool:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: a reader, or another process
    writing the same entry at once, sees the old file or a whole new one. False (nothing written) if the directory
    is not writable: callers then work uncached."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
