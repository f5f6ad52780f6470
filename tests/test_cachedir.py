"""Damaged cache entries (cachedir): found by their own structure, reported in one warning naming the file, removed
so that their owner rebuilds them; whole entries and entries another process may still be writing are left alone."""

import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from infer import kernels
from infer.cachedir import IN_PROGRESS_S, build_lock, compile_cache_damage, drop_damaged, elf_damage


def _a_shared_library() -> Path:
    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    assert lib.is_file(), lib
    return lib


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _age(root: Path, seconds: float = 2 * IN_PROGRESS_S) -> None:
    old = time.time() - seconds
    for p in root.rglob("*"):
        os.utime(p, (old, old))


def test_elf_damage_tells_a_whole_library_from_a_truncated_one(tmp_path):
    lib = tmp_path / "lib.so"
    shutil.copy(_a_shared_library(), lib)
    assert elf_damage(lib) is None
    _truncate(lib, lib.stat().st_size - 1)  # the section headers come last: one byte short is caught
    assert "truncated" in elf_damage(lib)
    _truncate(lib, 10)
    assert "not an ELF file" in elf_damage(lib)


def test_drop_damaged_removes_what_is_broken_and_keeps_the_rest(tmp_path):
    from torch._inductor.codecache import code_hash

    root = tmp_path / "inductor"
    (root / "ab").mkdir(parents=True)
    good_so, bad_so = root / "ab" / "cgood.so", root / "ab" / "cbad.main.so"
    shutil.copy(_a_shared_library(), good_so)
    shutil.copy(_a_shared_library(), bad_so)
    _truncate(bad_so, 4096)
    text = "def call(args):\n    return args\n"
    good_py = root / "ab" / f"{code_hash(text.strip())}.py"
    good_py.write_text(text)
    bad_py = root / "ab" / f"{code_hash('x = 1')}.py"
    bad_py.write_text("x = ")  # cut short: no longer the text its name hashes
    entry_dir = root / "fxgraph" / "fx" / "fxkey"
    entry_dir.mkdir(parents=True)
    good_pickle, bad_pickle = entry_dir / "entry1", entry_dir / "entry2"
    good_pickle.write_bytes(pickle.dumps({"graph": list(range(100))}))
    bad_pickle.write_bytes(pickle.dumps({"graph": list(range(100))})[:50])
    other = root / "ab" / "notes.txt"
    other.write_text("anything")
    _age(root)
    young = root / "ab" / "cyoung.so"  # being linked by another process right now: not judged
    young.write_bytes(b"\x7fELF")

    with pytest.warns(RuntimeWarning) as record:
        dropped = drop_damaged(root)
    assert sorted(p for p, _ in dropped) == sorted([bad_so, bad_py, bad_pickle])
    messages = [str(w.message) for w in record]
    assert len(messages) == 3 and all("\n" not in m for m in messages)
    for path in (bad_so, bad_py, bad_pickle):
        assert any(f"cache entry {path} is damaged" in m and "rebuilt" in m for m in messages)
        assert not path.exists()
    assert all(p.exists() for p in (good_so, good_py, good_pickle, other, young))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert drop_damaged(root) == []  # nothing left to report
        assert drop_damaged(tmp_path / "absent") == []
    assert compile_cache_damage(young) is not None  # judged damaged once old enough


def test_a_damaged_kernel_build_is_reported_and_rebuilt(tmp_path):
    build = tmp_path / kernels.build_name()
    build.mkdir()
    library = build / f"{kernels.build_name()}.so"
    shutil.copy(_a_shared_library(), library)
    assert kernels._intact_build(library)
    _truncate(library, 1000)
    with pytest.warns(RuntimeWarning, match=f"cached build {library} is damaged .*rebuilding it"):
        assert not kernels._intact_build(library)
    assert not build.exists()  # the build starts afresh
    assert not kernels._intact_build(library)  # absent: simply built


def test_a_damaged_tokenizer_entry_is_reported_and_converted_again(tmp_path, monkeypatch):
    """A GGUF's tokenizer is converted once and cached (infer.tokenizer); a damaged entry is converted again. A tiny
    GGUF (tests/test_gguf.py's writer) rather than SmolLM2's: the same code path, without ~9 s a conversion."""
    from infer.testing import make_tiny_llama
    from infer.tokenizer import Tokenizer, tokenizer_cache_dir
    from test_gguf import write_gguf

    gguf = write_gguf(make_tiny_llama(tmp_path / "tiny", "gqa"), tmp_path / "tiny.gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ids = Tokenizer(gguf).encode("Hello world")
    (entry,) = tokenizer_cache_dir().iterdir()
    (entry / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.warns(RuntimeWarning, match=f"cached tokenizer {entry} is damaged"):
        assert Tokenizer(gguf).encode("Hello world") == ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten whole
        assert Tokenizer(gguf).encode("Hello world") == ids


# --- the build lock ---------------------------------------------------------------------------------------------------
# torch's cpp_extension baton (a file `lock`) outlives a builder that was killed; build_lock's flock does not.

_HOLD = """
import os, sys, time
from pathlib import Path
from infer.cachedir import build_lock
d = Path(sys.argv[1])
with build_lock(d):
    (d / "lock").touch()  # torch's baton, as a build in progress has it
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    assert (d / "lock").exists(), "a live builder's baton was taken away"
    (d / "lock").unlink()
"""


def _holder(d: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(d), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_build_lock_removes_the_baton_of_a_killed_builder(tmp_path):
    proc = _holder(tmp_path, 600)
    proc.kill()  # mid-build: torch's baton stays behind
    proc.wait(timeout=30)
    assert (tmp_path / "lock").exists()
    with pytest.warns(RuntimeWarning, match="left by a build that was stopped"), build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_lock_waits_for_a_live_builder_and_leaves_its_baton(tmp_path):
    proc = _holder(tmp_path, 1.5)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no baton was stale
        with build_lock(tmp_path):
            waited = time.monotonic() - t0
    assert proc.wait(timeout=30) == 0  # the holder found its baton where it left it
    assert waited > 1.0


def test_the_suffix_tree_loads_past_a_stale_baton():
    """End to end: a stale baton in the suffix tree's build directory (torch alone would wait on it forever)."""
    from infer.proposers import suffix

    build = suffix.build_dir()
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()
    try:
        run = subprocess.run([sys.executable, "-c", "from infer.proposers.suffix import suffix_tree_module as m; "
                              "print(m().SuffixTree(4).num_nodes())"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "0", run.stderr[-2000:]
        assert "left by a build that was stopped" in run.stderr
    finally:
        (build / "lock").unlink(missing_ok=True)  # never leave the hang behind for later tests


def test_each_environment_keeps_its_own_build(monkeypatch):
    """Two virtualenvs of the same torch name other header paths in their compile lines (two checkouts other source
    paths, another $CXX another compiler): sharing one build directory, each rebuilt every kernel after the other had
    run (~45 s on 2 cores, twice that beside a test run). Each keeps a directory of its own; the build's name (what
    cost profiles and compiled graphs are keyed by) stays one."""
    import sysconfig

    from infer.proposers import suffix

    here = (kernels.build_dir(), suffix.build_dir(), kernels.build_name())
    assert (kernels.build_dir(), suffix.build_dir()) == here[:2]  # the same environment: the same directories
    assert kernels.build_dir().name.startswith(kernels.build_name())
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: "/elsewhere" if name == "include" else
                        real(name, *a, **k))
    assert kernels.build_dir() != here[0] and suffix.build_dir() != here[1]
    assert kernels.build_name() == here[2]
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")  # another compiler: other compile lines too
    assert kernels.build_dir() != here[0] and suffix.build_dir() != here[1]
    assert suffix.build_dir().name.isidentifier()  # the suffix tree's directory names its Python module
