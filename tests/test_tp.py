"""Tensor parallelism (model/tp.py) at TP = 2: two processes on this machine, gloo collectives. Greedy output equals
TP = 1 in float32 on a tiny checkpoint for 32 tokens, with and without speculation (the drafter unsharded on every
rank), and the joint law of two tokens from one speculative round, through the batched engine on both ranks, is the
target's (chi-square)."""

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


def _worker(rank, world, rdzv, target_dir, drafter_dir, out):
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
        out.put((rank, plain, spec, joint, eng.stats.acceptance_rate))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(ckpt_dirs, tmp_path_factory):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rdzv = tmp_path_factory.mktemp("tp") / "rendezvous"
    procs = [ctx.Process(target=_worker, args=(r, 2, str(rdzv), str(ckpt_dirs["gqa"]), str(ckpt_dirs["mha"]), out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_tp2_greedy_equals_tp1_with_and_without_speculation(tp2, ckpt_dirs):
    target, drafter = load_model(ckpt_dirs["gqa"]), load_model(ckpt_dirs["mha"])
    want = [autoregressive_generate(target, p, GREEDY, eos_token_ids=[]).output_ids for p in PROMPTS]
    for rank in (0, 1):
        plain, spec, _, _ = tp2[rank]
        assert plain == want and spec == want, rank


def test_tp2_speculative_joint_law_is_the_targets(tp2):
    (_, _, joint0, acc), (_, _, joint1, _) = tp2[0], tp2[1]
    assert joint0 == joint1  # the ranks stayed in step: same scheduling, same draws
    assert 0.1 < acc < 0.95
    counts = torch.zeros(V, V)
    for a, b in joint0:
        counts[a, b] += 1
    assert chi2_pvalue(counts, exact_joint(random_llama(V, seed=0), DIST, first=2, prompt=[1, 2, 3])) > 0.001


def test_what_tp_cannot_divide_is_named():
    from infer.model.tp import check_shardable

    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(random_llama(8).config, 4)  # 2 KV heads
