"""The cost model's profile on disk: measured once per machine and setting, read at every later start.

Profiling what a round costs (spec_decode.setup.measure_costs) times target forwards of B rows x T tokens and draft
steps, and under torch.compile it first needs every one of those graphs: most of a warm start before this store.
The profile depends only on what a step computes and where, so it is kept in ``~/.cache/infer/profiles`` under a key
naming all of that (``profile_key``): the CPU and its core count, torch's version, the kernels' build, the model file,
dtype, quantization, compilation, the drafter (its quantization too: an int8 drafter's rounds are one C++ call, ~10x
cheaper than its bfloat16 steps), the proposer, the pool and the profiled widths. A file whose key differs
is another setting's and is never read as this one's.

    store = ProfileStore()                     # $XDG_CACHE_HOME/infer/profiles
    costs = store.load(key)                    # CostModel | None (None: absent; corrupt or foreign: warned, None)
    store.save(key, costs)                     # atomic: a temporary file renamed over the old one

Rounds keep refreshing the loaded model (CostModel.refresh_*); the engine saves it back now and then, so the next
start begins from the levels measured in use rather than from the start-up profile: the verify line fitted over the
forwards (``fit``) and each k's measured round of drafts (``rounds``). Without the latter a restart priced SmolLM2's
EAGLE-3 rounds from the profile's lone draft step again (on the Xeon 0.46 ms a step, 1.85 ms for 4, against 0.6-0.9 ms
measured for a round of 4) until its rounds had drafted each k anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from pathlib import Path

import torch

from ..cachedir import cache_dir, write_atomic
from .cost_model import CostModel

FORMAT = 4  # bumped when the file's layout or the meaning of its numbers changes (4: verify points cut, profile_costs)


def default_dir() -> Path:
    return cache_dir("profiles")


def cpu_name() -> str:
    """The CPU model as the OS names it (x86 Linux: /proc/cpuinfo's "model name"), else platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def file_identity(path) -> str | None:
    """A model file's (or directory's) identity for the key: resolved path, size and modification time of every
    file under it. A rewritten checkpoint gets a new key without hashing gigabytes."""
    if path is None:
        return None
    p = Path(path).expanduser().resolve()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    h = hashlib.sha256(str(p).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def profile_key(**setting) -> dict:
    """What a profile depends on: the machine's part added to the engine's ``setting`` (plain JSON values)."""
    from .. import kernels

    return {"format": FORMAT, "cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernels.build_name(), **setting}


class ProfileStore:
    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = Path(directory) if directory is not None else default_dir()

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.dir / f"costs-{digest}.json"

    def load(self, key: dict) -> CostModel | None:
        """The stored profile for ``key``; None if there is none. A file that cannot be read as one (truncated, not
        JSON, another key, tables of the wrong size) is reported in one warning naming it, and None returned: the
        caller profiles anew and ``save`` replaces it."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"cost profile {path} unreadable ({e}); profiling anew", RuntimeWarning, stacklevel=2)
            return None
        try:
            data = json.loads(text)
            if data.get("key") != key:
                raise ValueError("it was written for another setting")
            return _from_json(data["costs"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            warnings.warn(f"cost profile {path} is corrupt or stale ({type(e).__name__}: {e}); profiling anew",
                          RuntimeWarning, stacklevel=2)
            return None

    def save(self, key: dict, costs: CostModel) -> Path | None:
        """Write atomically (a temporary file in the same directory, renamed over the target): a reader, or another
        process saving at the same moment, sees the old file or a whole new one, never a mix. None if the cache
        directory is not writable (a read-only home): the profile is then measured at every start, as before."""
        path = self.path(key)
        return path if write_atomic(path, json.dumps({"key": key, "costs": _to_json(costs)})) else None


def _to_json(c: CostModel) -> dict:
    return {"max_batch": c.max_batch, "k_max": c.k_max, "verify": c.verify, "draft": c.draft,
            "draft_first": c.draft_first,
            # only the k the table prices (a longer round, were one ever measured, would make the file unreadable)
            "rounds": [{str(k): v for k, v in r.items() if 1 <= k <= c.k_max} for r in c.rounds],
            "fit": {str(b): s for b, s in c.fit.items()}, "last_scale": c.last_scale, "catch_up": c.catch_up}


def _from_json(d: dict) -> CostModel:
    """Rebuild and check the shapes: [max_batch + 1][k_max + 2] positive verify costs, [max_batch + 1] draft costs."""
    mb, km = int(d["max_batch"]), int(d["k_max"])
    verify = [[float(x) for x in row] for row in d["verify"]]
    draft = [float(x) for x in d["draft"]]
    first = [float(x) for x in d["draft_first"]]
    if mb < 1 or km < 0 or len(verify) != mb + 1 or any(len(r) != km + 2 for r in verify) or len(draft) != mb + 1 \
            or len(first) != mb + 1:
        raise ValueError(f"tables do not match max_batch={mb}, k_max={km}")
    if any(x <= 0 or x != x for r in verify[1:] for x in r[1:]) or any(x < 0 or x != x for x in draft + first):
        raise ValueError("a cost is not a positive number")
    fit = {int(b): [float(x) for x in s] for b, s in d.get("fit", {}).items()}
    if any(not 1 <= b <= mb or len(s) != 5 or s[0] <= 0 or s[1] <= 0 or any(x != x or abs(x) == float("inf")
                                                                              for x in s) for b, s in fit.items()):
        raise ValueError("a fitted line is not five finite sums of a batch size with forwards")
    # the rounds' measured draft prices (k -> seconds per batch size); a file from before they were kept has none
    rounds = [{int(k): float(v) for k, v in r.items()} for r in d.get("rounds", [{}] * (mb + 1))]
    if len(rounds) != mb + 1 or any(not 1 <= k <= km or not 0 < v < float("inf") for r in rounds for k, v in r.items()):
        raise ValueError(f"the rounds' draft prices do not match max_batch={mb}, k_max={km}")
    return CostModel(mb, km, verify, draft, first, rounds, fit=fit, last_scale=float(d.get("last_scale", 1.0)),
                     catch_up=float(d.get("catch_up", 0.0)))
