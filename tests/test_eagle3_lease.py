"""scripts/eagle3_lease.py, a GPU lease's run packed into the device tool's calls: the GGUF's parts join back to
the same bytes (the last call checks the sum it wrote), and the index goes out and back without touching a file."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import eagle3_lease  # noqa: E402


def test_the_parts_join_to_the_file_and_its_sum(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(bytes(range(256)) * 41 + b"tail")
    line = eagle3_lease.split_file(src, tmp_path / "a", tmp_path / "b", 1000)
    assert (tmp_path / "a").stat().st_size == 1000
    joined = (tmp_path / "a").read_bytes() + (tmp_path / "b").read_bytes()
    assert joined == src.read_bytes() and line == f"{hashlib.sha256(joined).hexdigest()}  SmolLM2.gguf\n"


def _repo(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_bytes(b"x" * 5000)
    (tmp_path / "keep.py").write_text("print(1)\n")
    (tmp_path / ".gitignore").write_text("/.lease/\n")
    (tmp_path / ".git" / "info").mkdir(exist_ok=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("# mine\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    return git


def test_untrack_and_retrack_leave_the_files_and_restore_the_index(tmp_path):
    """The paths leave the index and do not come back as untracked files (what a call carries shrinks); retrack
    puts back exactly them and the exclude file, keeping another staged change; neither runs twice."""
    git = _repo(tmp_path)
    (tmp_path / "keep.py").write_text("print(2)\n")
    git("add", "keep.py")  # staged work that must survive
    eagle3_lease.untrack(tmp_path, ["data", "nothing/here"])
    assert git("ls-files").split() == [".gitignore", "keep.py"]
    assert "data" not in git("status", "--short", "--untracked-files=all").replace("D  data/big.bin", "")
    assert (tmp_path / "data" / "big.bin").stat().st_size == 5000
    (tmp_path / "new.txt").write_text("abc")  # untracked, not ignored: it travels too
    assert eagle3_lease.tree_bytes(tmp_path) == len("/.lease/\n") + len("print(2)\n") + 3
    with pytest.raises(SystemExit, match="already"):
        eagle3_lease.untrack(tmp_path, ["data"])
    eagle3_lease.retrack(tmp_path)
    assert git("ls-files").split() == [".gitignore", "data/big.bin", "keep.py"]
    assert git("status", "--short").split("\n")[0] == "M  keep.py"
    assert (tmp_path / ".git" / "info" / "exclude").read_text() == "# mine\n"
    with pytest.raises(SystemExit, match="nothing to retrack"):
        eagle3_lease.retrack(tmp_path)


def test_retrack_refuses_after_a_commit_that_dropped_the_paths(tmp_path):
    git = _repo(tmp_path)
    eagle3_lease.untrack(tmp_path, ["data"])
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "oops")
    with pytest.raises(SystemExit, match="HEAD moved"):
        eagle3_lease.retrack(tmp_path)


def test_the_calls_scripts_parse():
    for name, script in eagle3_lease.GO.items():
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        assert "python " not in script, name  # python3: what a bare image is sure to have
