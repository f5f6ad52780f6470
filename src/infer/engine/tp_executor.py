"""The tensor-parallel executor: this process is rank 0 and runs the whole engine; N-1 worker processes repeat its
target computations on their shards.

    Engine(EngineConfig(model=..., tensor_parallel_size=2))      # or LLM(..., tensor_parallel_size=2), --tensor-parallel-size 2

Rank 0 schedules, drafts, samples, verifies and rolls back exactly as with one process; only the target model and
its KV pool are sharded (model/tp.py). Its model is wrapped in a ``TPDriver``, which sends every target call to the
workers over a control channel before running its own shard, and the collectives inside the shards then meet:

    ("pool", key, kind, layout)      a KV pool rank 0 just used for the first time: each worker builds the same
                                     layout for its own KV heads (KVCachePool.layout)
    ("fwd", key, ids, positions, meta)  one forward: the AttnMeta rank 0's pool planned (positions, write and read
                                     addresses, mask) addresses the worker's pool too, so a worker keeps no
                                     bookkeeping: slots, block tables, prefix-cache sharing, rollback (a length)
                                     exist on rank 0 only
    ("logits", hidden)               compute_logits: the vocabulary-parallel head's all-gather
    ("copy", key, op, args)          a storage copy outside a forward (tree compaction: KVCachePool._replay)
    ("stop",)

Every decision (K per round, auto trees, sampling, seeds) is made once, on rank 0: no pinned K or seeded requests are
needed, unlike running the engine SPMD on every rank. The drafter (a draft model or n-gram; TP 1) runs on rank 0 only
(docs/scaling.md measures it against drafting on every rank). Control messages are pickled by
``broadcast_object_list`` over a gloo group of their own (CPU tensors, also under NCCL); the shards' collectives use
the default group (gloo on CPU, NCCL on CUDA).

Sizing: every rank's pool has rank 0's layout (blocks, slots); ``kv_cache_memory_mb`` is priced with rank 0's KV
heads, so a rank holding more heads (SmolLM2's 3 over 2 ranks: 1 + 2) uses proportionally more.

Failure: a worker that exits is seen before the next message (its process is gone) or inside a collective (gloo sees
the connection close); both raise TensorParallelError naming the rank, which the engine loop turns into an error for
every request in flight. Rank 0 exiting closes the workers' control channel: they exit too.
"""

from __future__ import annotations

import atexit
import collections
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..model.tp import TensorParallelError, shard_model

# A worker waits on the control channel for as long as the server is idle: no timeout there. The shards'
# collectives time out after COLLECTIVE_TIMEOUT (every rank does the same work, so a wait that long is a lost rank).
IDLE_TIMEOUT = timedelta(days=365)
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def _meta_to(meta, device):
    """An AttnMeta with its tensors on ``device`` (CPU to send, the worker's device to use)."""
    if meta is None:
        return None
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return type(meta)(**fields)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


class TPDriver(nn.Module):
    """Rank 0's target: the shard, behind the same interface, announcing every call to the workers first."""

    def __init__(self, model: nn.Module, executor: TensorParallelExecutor):
        super().__init__()
        self.model, self.executor = model, executor

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, input_ids, positions=None, kv=None, attn_meta=None):
        key = None if kv is None else self.executor.register(kv)
        self.executor.send(("fwd", key, input_ids.cpu(), None if positions is None else positions.cpu(),
                            _meta_to(attn_meta, "cpu")))
        try:
            return self.model(input_ids, positions, kv, attn_meta)
        except TensorParallelError as e:
            raise self.executor.diagnose(e) from e

    def compute_logits(self, hidden: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        self.executor.send(("logits", hidden.cpu(), lens))  # lens: the pads to skip, a CPU tensor (llama.py)
        try:
            return self.model.compute_logits(hidden, lens)
        except TensorParallelError as e:
            raise self.executor.diagnose(e) from e


class TensorParallelExecutor:
    """Starts the workers and the process group; ``wrap(model)`` shards rank 0's model and returns its TPDriver."""

    def __init__(self, world: int, model_path: str, dtype: torch.dtype, device: str):
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1: this process already belongs to a torch.distributed process "
                               "group (one tensor-parallel engine per process)")
        self.world = world
        dev = torch.device(device)
        self.backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} CUDA devices, "
                             f"{torch.cuda.device_count()} visible")
        self.device = torch.device("cuda", 0) if dev.type == "cuda" else dev
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.errors = ctx.SimpleQueue()  # a worker's traceback, read when rank 0 sees it gone
        self.procs = [ctx.Process(target=_worker_main, name=f"infer-tp-{r}", daemon=True,
                                  args=(r, world, init, str(model_path), dtype, self.backend, self.errors))
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        if dev.type == "cpu":  # the ranks share the cores
            torch.set_num_threads(_threads_per_rank(world))
        dist.init_process_group(self.backend, init_method=init, rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        self.ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._pools: dict[int, object] = {}  # key -> pool (kept alive so keys stay unique)
        self.sent: collections.Counter = collections.Counter()  # messages by kind
        self.closed = False
        atexit.register(self.close)

    def wrap(self, model: nn.Module) -> TPDriver:
        shard_model(model)
        self._call(dist.barrier, group=self.ctrl)  # every worker has loaded and sharded its model
        return TPDriver(model, self)

    # -- the control channel -----------------------------------------------------------------------------------
    def register(self, pool) -> int:
        """The key of a pool the workers mirror; the first use announces its layout and hooks its storage copies."""
        key = id(pool)
        if key not in self._pools:
            self.send(("pool", key, type(pool).__name__, pool.layout()))
            self._pools[key] = pool
            pool.mirror = self._mirror
        return key

    def _mirror(self, pool, op: str, args) -> None:
        self.send(("copy", self.register(pool), op, args))

    def send(self, msg) -> None:
        lost = self._lost()
        if lost:
            raise TensorParallelError(lost)
        self._call(dist.broadcast_object_list, [msg], 0, group=self.ctrl)
        self.sent[msg[0]] += 1

    def _lost(self) -> str:
        """'' while every worker runs, else which one exited and how."""
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                return f"tensor-parallel worker rank {r} (pid {p.pid}) {how}{self._worker_error()}"
        return ""

    def diagnose(self, err: TensorParallelError) -> TensorParallelError:
        """A failed collective, named by the worker that is gone when one is (its exit is seen within a second)."""
        for _ in range(10):
            lost = self._lost()
            if lost:
                return TensorParallelError(f"{lost}; the step's {err}")
            time.sleep(0.1)
        return err

    def _call(self, op, *args, group) -> None:
        try:
            op(*args, group=group)
        except RuntimeError as e:
            raise self.diagnose(TensorParallelError(f"tensor-parallel {op.__name__} failed on rank 0 of {self.world}: "
                                                    f"a worker is gone or timed out ({str(e).splitlines()[0][:200]})")) from e

    def _worker_error(self) -> str:
        return "" if self.errors.empty() else f": {self.errors.get()}"

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent; also at exit)."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self.send(("stop",))
        except TensorParallelError:
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group broken by a lost worker may not tear down cleanly
            pass


def _worker_main(rank: int, world: int, init: str, model_path: str, dtype: torch.dtype, backend: str,
                 errors) -> None:
    """A worker: load and shard the model, then repeat rank 0's target calls until told to stop or rank 0 is gone."""
    from ..cache import PagedKVCachePool, SlottedKVCache
    from ..model.loader import load_model

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cpu":
            torch.set_num_threads(_threads_per_rank(world))
        else:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        model = shard_model(load_model(model_path, dtype, "cpu")).to(device)  # 1/N of it on the device
        dist.barrier(group=ctrl)
        kinds = {"PagedKVCachePool": PagedKVCachePool, "SlottedKVCache": SlottedKVCache}
        pools = {}
        with torch.inference_mode():
            while True:
                box = [None]
                dist.broadcast_object_list(box, 0, group=ctrl)
                op, *args = box[0]
                if op == "fwd":
                    key, ids, positions, meta = args
                    model(ids.to(device), None if positions is None else positions.to(device), pools.get(key),
                          _meta_to(meta, device))
                elif op == "logits":
                    model.compute_logits(args[0].to(device), args[1])
                elif op == "copy":
                    key, name, a = args
                    getattr(pools[key], name)(*a)
                elif op == "pool":
                    key, kind, layout = args
                    pools[key] = kinds[kind].for_model(model, **layout)
                elif op == "stop":
                    break
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - rank 0 reports it; a closed channel (rank 0 gone) ends quietly
        if not (isinstance(e, RuntimeError) and "Connection closed by peer" in str(e)):
            errors.put(f"rank {rank}: {''.join(traceback.format_exception_only(type(e), e)).strip()}")
            traceback.print_exc()
        os._exit(1)
