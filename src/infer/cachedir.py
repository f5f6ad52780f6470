"""infer's on-disk caches: where they live and how a file is written so that no reader ever sees half of it.

Everything infer caches sits under ``$XDG_CACHE_HOME/infer`` (default ``~/.cache/infer``): kernels/ (the C++
build), inductor/ (torch's compile caches), tokenizers/ (GGUF tokenizers converted), gguf/ (GGUF indexes),
profiles/ (the cost model's profiles). Each entry is keyed by what it was built from, so a stale one is never read as
current; a damaged one is reported and rebuilt by its owner.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold across torch's ``cpp_extension.load`` into ``build_dir``: one builder at a time, and never a wait on a
    dead one. torch's own lock (its "baton", a file ``lock`` made with O_EXCL and removed when the build ends)
    outlives a builder that was killed, and every later load then waits on it forever (a server stopped during its
    first start, a test that kills a worker). This lock is an flock, which the kernel releases when its holder dies:
    whoever holds it is the only live builder among those that take it, so a baton found then is stale, and goes.
    Where flock is missing (not Linux or macOS), torch's baton alone serves."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(build_dir / ".infer-build.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a live builder (a first build takes ~30 s)
        baton = build_dir / "lock"
        if baton.exists():
            warnings.warn(f"removed {baton}, left by a build that was stopped", RuntimeWarning, stacklevel=3)
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


# --- damaged entries ------------------------------------------------------------------------------------------------
# Whole files are what atomic writes guarantee, but not every writer writes atomically: the C++ compiler and linker
# write their objects and libraries in place, so a process stopped mid-build (Ctrl-C at a first start, a full disk)
# leaves a truncated library that the next start would load and fail on (inductor then fails to compile every graph
# that needs it; dlopen refuses infer's kernels). Such entries are found by their own structure and removed: the
# owner rebuilds what is missing. Files younger than IN_PROGRESS_S may still be written by another process: left.
IN_PROGRESS_S = 600.0


def elf_damage(path: Path) -> str | None:
    """Why an ELF file (a .so or .o) is not whole, or None. Its section header table, which compilers write last,
    must lie inside the file: a truncated file fails that."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        return f"unreadable: {e.strerror}"
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return "not an ELF file (truncated?)"
    if head[4] != 2:  # ELFCLASS64: the only class these x86-64/aarch64 builds make
        return None
    order = "little" if head[5] == 1 else "big"
    shoff = int.from_bytes(head[0x28:0x30], order)
    shentsize, shnum = int.from_bytes(head[0x3A:0x3C], order), int.from_bytes(head[0x3C:0x3E], order)
    if shoff + shentsize * shnum > size:
        return f"truncated ({size} bytes, its section headers end at {shoff + shentsize * shnum})"
    return None


def compile_cache_damage(path: Path) -> str | None:
    """Why one file of inductor's cache is damaged, or None (also for kinds it cannot judge).
    - libraries and objects: elf_damage;
    - generated Python modules: inductor names each by the hash of its stripped text, which must match;
    - pickled graph entries (fxgraph/, aotautograd/): a pickle ends with its STOP opcode."""
    suffix = path.suffix
    if suffix in (".so", ".o"):
        return elf_damage(path)
    try:
        if suffix == ".py" and len(path.stem) == 52 and path.stem.startswith("c"):
            from torch._inductor.codecache import code_hash

            return None if code_hash(path.read_text().strip()) == path.stem else "its text does not match its name"
        if not suffix and {"fxgraph", "aotautograd"} & set(path.parts):
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                return None if f.read(1) == b"." else "truncated pickle"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable: {e}"
    return None


def drop_damaged(root: Path, judge=compile_cache_damage, now: float | None = None) -> list[tuple[Path, str]]:
    """Remove every damaged file under ``root`` (``judge(path)`` -> why, or None), leaving files younger than
    IN_PROGRESS_S (another process may be writing them); warns once per file, naming it. Returns (path, why)."""
    import time
    import warnings

    now = time.time() if now is None else now
    dropped = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
        try:
            if now - path.stat().st_mtime < IN_PROGRESS_S or (why := judge(path)) is None:
                continue
            path.unlink()
        except OSError:
            continue
        dropped.append((path, why))
        warnings.warn(f"cache entry {path} is damaged ({why}); removed, it will be rebuilt", RuntimeWarning,
                      stacklevel=2)
    return dropped
