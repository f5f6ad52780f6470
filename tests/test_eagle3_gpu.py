"""scripts/eagle3_gpu.py, the EAGLE-3 head's data and training on a lent GPU: what it computes on the device must be
what the CPU pipeline stores (train_heads.load_items3's items), or the head trains on shifted targets without a
sign; and its packing must extend data/drafter-answers without losing or reordering a row. Tiny models, the CPU."""

import argparse
import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import eagle3_gpu  # noqa: E402
from infer.model import load_model  # noqa: E402
from infer.testing import make_tiny_llama  # noqa: E402


def test_teacher_items_line_up_with_the_answers(tmp_path):
    """Item conventions (load_items3): ids = (prompt + answer[:-1]) cut from the left to maxlen, aux [T, n H] the
    captured layers, top_ids[a] the target's top tokens after answer token a - 1, i.e. at position first + a; a cut
    into the answer leaves rows a < -first unused (never indexed by collate3)."""
    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0)
    model = load_model(path)
    model.capture_layers((0, 1))
    H, V = model.config.hidden_size, model.config.vocab_size
    rows = [{"job": 0, "prompt_ids": [3, 4, 5, 6], "answer_ids": [7, 8, 9]},
            {"job": 1, "prompt_ids": [1, 2], "answer_ids": [10, 11, 12, 13, 14, 15]}]  # cut at 6: first = -1
    items, _ = eagle3_gpu.teacher(path, rows, "cpu", batch=2, layers=(0, 1), maxlen=6)
    assert [it["index"] for it in items] == [0, 1]
    for it, r in zip(items, rows):
        seq = (r["prompt_ids"] + r["answer_ids"][:-1])[-6:]
        assert it["ids"].tolist() == seq and it["answer"].tolist() == r["answer_ids"]
        assert it["first"] == len(seq) - len(r["answer_ids"]) and len(it["top_ids"]) == len(r["answer_ids"])
        with torch.no_grad():
            out = model(torch.tensor([seq]))[0]
            logp = model.compute_logits(out).log_softmax(-1)
        assert it["aux"].shape == (len(seq), 2 * H) and torch.equal(it["aux"], out[:, H:].to(torch.bfloat16))
        for a in range(max(0, -it["first"]), len(r["answer_ids"])):
            p = it["first"] + a  # the position whose next token is answer a
            assert it["top_ids"][a, 0] == logp[p].argmax()
            assert abs(float(it["top_logp"][a, 0]) - float(logp[p].max())) < 1e-2
        assert V > int(it["top_ids"].max())


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_teacher_items_past_the_devices_budget_keep_their_layers_on_the_host(tmp_path, capsys, device):
    """A budget the items outgrow (96,457 conversations' layers are ~66 GB, past an H100's memory) moves a batch's
    captured layers to the host instead of failing: the same items, in the same order, and the same training batch
    on the device (collate3 copies them over); item_bytes counts what the items hold. A deadline cuts the pass after
    whole batches, at least one."""
    from train_heads import collate3

    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0)
    rows = [{"job": j, "prompt_ids": list(range(1, 3 + 3 * j)), "answer_ids": list(range(5, 8 + j % 3))}
            for j in range(6)]  # the last two longer than maxlen: cut from the left
    kw = dict(batch=2, layers=(0, 1), maxlen=16, seed=3)
    whole, _ = eagle3_gpu.teacher(path, rows, device, budget=float("inf"), **kw)
    for it, r in zip(whole, rows):
        held = sum(t.untyped_storage().nbytes() for t in (it["ids"], it["aux"], it["top_ids"], it["top_logp"]))
        assert held == eagle3_gpu.item_bytes(r, 16, it["aux"].shape[1])
    first = sum(eagle3_gpu.item_bytes(r, 16, whole[0]["aux"].shape[1]) for r in rows[:2])
    capsys.readouterr()
    spilled, _ = eagle3_gpu.teacher(path, rows, device, budget=first, **kw)  # room for a batch at most
    report = capsys.readouterr().err
    assert "6 of 6 conversations" in report and "GiB of their layers on the host" in report
    on_host = [it["aux"].device.type == "cpu" for it in spilled]
    if device != "cpu":
        assert 4 <= sum(on_host) <= 6 and all(it["ids"].device.type == "cuda" for it in spilled)
    assert [it["index"] for it in spilled] == [it["index"] for it in whole] == list(range(6))
    for a, b in zip(whole, spilled):
        for k in ("ids", "aux", "top_ids", "top_logp", "answer"):
            assert torch.equal(a[k].cpu(), b[k].cpu()), k
    for x, y in zip(collate3(whole), collate3(spilled)):
        assert x.device == y.device and torch.equal(x, y)
    cut, _ = eagle3_gpu.teacher(path, rows, device, budget=float("inf"), deadline=0.0, **kw)
    assert len(cut) == 2 and "cut at its deadline" in capsys.readouterr().err
    for it in cut:
        b = whole[it["index"]]
        assert torch.equal(it["aux"].cpu(), b["aux"].cpu()) and torch.equal(it["top_ids"].cpu(), b["top_ids"].cpu())


def test_install_packs_consecutive_answers_and_completes_a_partial_file(tmp_path, monkeypatch):
    packed = tmp_path / "packed"
    packed.mkdir()
    monkeypatch.setattr(eagle3_gpu, "PACK_ROWS", 4)
    monkeypatch.setattr(eagle3_gpu, "PACKED", packed)

    def write(path, jobs):
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"job": j, "answer_ids": [j]}) + "\n" for j in jobs)

    def read(path):
        with gzip.open(path, "rt") as f:
            return [json.loads(line)["job"] for line in f]

    write(packed / "answers-000.jsonl.gz", range(0, 4))
    run1, run2 = tmp_path / "r1", tmp_path / "r2"
    run1.mkdir(), run2.mkdir()
    write(run1 / "answers-new.jsonl.gz", range(4, 10))  # a full file and a partial one
    eagle3_gpu.install([run1], None)
    assert read(packed / "answers-001.jsonl.gz") == [4, 5, 6, 7] and read(packed / "answers-002.jsonl.gz") == [8, 9]
    write(run2 / "answers-new.jsonl.gz", [10, 11, 12, 14])  # 13 missing: 14 must wait
    eagle3_gpu.install([run2], None)
    assert read(packed / "answers-002.jsonl.gz") == [8, 9, 10, 11]
    assert read(packed / "answers-003.jsonl.gz") == [12]
    assert sorted(p.name for p in packed.iterdir()) == [f"answers-00{i}.jsonl.gz" for i in range(4)]


def test_answer_on_the_cpu_goes_in_job_order_resumes_and_installs(tmp_path, monkeypatch):
    """`answer` (the jobs answered in a CPU session's background): the unanswered jobs in job order, at most --num;
    a second call resumes from its own file (a gzip member a batch) and answers only what is left; install packs the
    rows after the packed ones."""
    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0, max_position_embeddings=2048)
    monkeypatch.setattr(eagle3_gpu, "MAX_TOKENS", 6)
    packed = tmp_path / "packed"
    packed.mkdir()
    monkeypatch.setattr(eagle3_gpu, "PACK_ROWS", 4)
    monkeypatch.setattr(eagle3_gpu, "PACKED", packed)
    temps = [0.7, 0.0, 0.7, 0.0, 0.7, 0.0]
    rows = [{"job": j, "source": f"s{j // 2}", "kind": "chat", "temperature": t, "prompt_ids": [3 + j // 2, 4, 5],
             "answer_ids": [1, 2] if j < 2 else None, "finish_reason": "stop" if j < 2 else None}
            for j, t in enumerate(temps)]
    with gzip.open(tmp_path / "packed" / "answers-000.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({k: r[k] for k in ("job", "source", "temperature", "answer_ids", "finish_reason")})
                     + "\n" for r in rows[:2])
    jobs = tmp_path / "jobs.json.gz"
    with gzip.open(jobs, "wt") as f:
        json.dump(rows, f)
    out = tmp_path / "cpu"

    def answered():
        with gzip.open(out / "answers-new.jsonl.gz", "rt") as f:
            return [json.loads(line) for line in f]

    args = dict(jobs=jobs, model=path, out=out, seconds=600, gen_batch=2, seed=0)
    eagle3_gpu.answer(argparse.Namespace(**args, num=3))  # two batches: jobs 2, 3, then 4
    first = answered()
    assert [r["job"] for r in first] == [2, 3, 4]
    assert all(1 <= len(r["answer_ids"]) <= 6 and r["finish_reason"] in ("stop", "length") for r in first)
    assert [r["temperature"] for r in first] == temps[2:5] and "cpu" in first[0]["answered_on"]
    eagle3_gpu.answer(argparse.Namespace(**args, num=None))  # resumes: only job 5 is left
    assert answered()[:3] == first and [r["job"] for r in answered()] == [2, 3, 4, 5]
    eagle3_gpu.install([out], None)
    with gzip.open(packed / "answers-000.jsonl.gz", "rt") as f:
        assert [json.loads(line)["job"] for line in f] == [0, 1, 2, 3]
    with gzip.open(packed / "answers-001.jsonl.gz", "rt") as f:
        assert [json.loads(line)["answer_ids"] for line in f] == [r["answer_ids"] for r in answered()[2:]]


def test_the_targets_own_prompts_are_its_closed_turns_numbered_and_packed_apart(tmp_path, monkeypatch):
    """--magpie: each prompt is the template's prefix, the ids the target wrote before its end of turn (the stop
    token dropped), the suffix; only turns it closed itself, of 4+ ids, once each; numbered from the first job given,
    alternately at 0.7 and greedy. install packs them apart from the listed jobs, prompts kept, never twice."""
    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0, max_position_embeddings=2048, logit_scale=1.0)
    from infer.llm import LLM

    eos = set(LLM(path, compile=False).eos_token_ids)
    template = {"prefix": [5, 6, 7], "suffix": [8, 9]}
    rows = eagle3_gpu.magpie(path, template, 6, "cpu", float("inf"), batch=4, seed=0,
                             first_job=eagle3_gpu.MAGPIE_BASE + 3)
    assert 1 <= len(rows) <= 6
    assert [r["job"] for r in rows] == list(range(eagle3_gpu.MAGPIE_BASE + 3, eagle3_gpu.MAGPIE_BASE + 3 + len(rows)))
    assert [r["temperature"] for r in rows] == [(0.7, 0.0)[i % 2] for i in range(len(rows))]
    users = [r["prompt_ids"][3:-2] for r in rows]
    assert all(r["prompt_ids"][:3] == [5, 6, 7] and r["prompt_ids"][-2:] == [8, 9] for r in rows)
    assert all(len(u) >= 4 and not eos & set(u) for u in users) and len({tuple(u) for u in users}) == len(users)
    assert all(r["answer_ids"] is None and r["kind"] == "magpie" for r in rows)

    packed, own = tmp_path / "packed", tmp_path / "own"
    packed.mkdir()
    monkeypatch.setattr(eagle3_gpu, "PACK_ROWS", 4)
    monkeypatch.setattr(eagle3_gpu, "PACKED", packed)
    monkeypatch.setattr(eagle3_gpu, "MAGPIE", own)
    run = tmp_path / "r"
    run.mkdir()
    with gzip.open(run / "answers-new.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"job": j, "answer_ids": [j % 7]}) + "\n" for j in range(3))
        f.writelines(json.dumps({**r, "answer_ids": [1, 2]}) + "\n" for r in rows)
    eagle3_gpu.install([run], None)
    eagle3_gpu.install([run], None)  # again: nothing new
    with gzip.open(packed / "answers-000.jsonl.gz", "rt") as f:
        assert [json.loads(line)["job"] for line in f] == [0, 1, 2]
    assert [p.name for p in own.iterdir()] == ["magpie-000.jsonl.gz"]
    with gzip.open(own / "magpie-000.jsonl.gz", "rt") as f:
        back = [json.loads(line) for line in f]
    assert [r["prompt_ids"] for r in back] == [r["prompt_ids"] for r in rows]


def test_validation_reads_both_kinds_and_keeps_most_of_the_targets_prompts_for_training():
    items = [{"index": i} for i in range(1000)] + [{"index": eagle3_gpu.MAGPIE_BASE + i} for i in range(50)]
    train, val = eagle3_gpu.split_jobs(items)
    assert len(train) + len(val) == 1050 and not {id(t) for t in train} & {id(v) for v in val}
    own = [v for v in val if v["index"] >= eagle3_gpu.MAGPIE_BASE]
    assert len(own) == 10 and len(val) == 31 and [v["index"] for v in val[:21]] == list(range(979, 1000))
    assert eagle3_gpu.split_jobs(items[:1000]) == (items[:970], items[970:1000])


def test_own_repeat_draws_the_targets_prompts_that_many_times_as_often():
    items = [{"index": i} for i in range(6)] + [{"index": eagle3_gpu.MAGPIE_BASE + i} for i in range(2)]
    assert eagle3_gpu.weight_own(items, 1) == items
    fit = eagle3_gpu.weight_own(items, 3)
    counts = {it["index"]: sum(x is it for x in fit) for it in items}
    assert counts == {**{i: 1 for i in range(6)}, eagle3_gpu.MAGPIE_BASE: 3, eagle3_gpu.MAGPIE_BASE + 1: 3}
    with pytest.raises(ValueError, match="own-repeat"):
        eagle3_gpu.weight_own(items, 0)


def test_a_bad_own_repeat_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        eagle3_gpu.main(["run", "--jobs", str(tmp_path / "none.json.gz"), "--model", "none.gguf",
                         "--out", str(tmp_path / "out"), "--own-repeat", "0"])
    assert "--own-repeat must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_own_prompts_on_the_cpu_number_after_the_packed_ones_resume_and_install(tmp_path, monkeypatch):
    """`own` (the target's prompts and answers in a CPU session's background): numbered after the packed ones and
    after its own file's, each with its prompt and answer; install packs them. The prompts' stage is the one tested
    above, stubbed here (a random model seldom closes its turn: a timed run could ask for none)."""
    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0, max_position_embeddings=2048)
    asked = []

    def magpie(model, template, n, device, deadline, batch, seed, first_job, **engine):
        asked.append((first_job, engine))
        return [{"job": first_job + i, "source": f"magpie:{first_job + i}", "kind": "magpie", "temperature": 0.7,
                 "prompt_ids": template["prefix"] + [10 + i, 11, 12, 13] + template["suffix"], "answer_ids": None,
                 "finish_reason": None} for i in range(n)]

    monkeypatch.setattr(eagle3_gpu, "magpie", magpie)
    own = tmp_path / "own"
    own.mkdir()
    monkeypatch.setattr(eagle3_gpu, "MAGPIE", own)
    monkeypatch.setattr(eagle3_gpu, "MAX_TOKENS", 6)
    monkeypatch.setattr(eagle3_gpu, "chat_turn", lambda tok: {"prefix": [5, 6, 7], "suffix": [8, 9]})
    with gzip.open(own / "magpie-000.jsonl.gz", "wt") as f:
        f.write(json.dumps({"job": eagle3_gpu.MAGPIE_BASE + 4, "prompt_ids": [5, 6, 7, 1, 1, 1, 1, 8, 9],
                            "answer_ids": [3]}) + "\n")
    out = tmp_path / "cpu"
    args = dict(model=path, out=out, chunk=3, gen_batch=2, seed=0, quantization=None)

    def answered():
        with gzip.open(out / "answers-new.jsonl.gz", "rt") as f:
            return [json.loads(line) for line in f]

    eagle3_gpu.own_prompts(argparse.Namespace(**args, seconds=3))
    first = answered()
    assert first and first[0]["job"] == eagle3_gpu.MAGPIE_BASE + 5
    assert asked[0] == (first[0]["job"], {"quantization": None})
    jobs = [r["job"] for r in first]
    assert jobs == sorted(set(jobs))
    assert all(r["prompt_ids"][:3] == [5, 6, 7] and r["prompt_ids"][-2:] == [8, 9] and 1 <= len(r["answer_ids"]) <= 6
               for r in first)
    eagle3_gpu.own_prompts(argparse.Namespace(**args, seconds=2))  # goes on after its own last job
    assert answered()[:len(first)] == first and all(r["job"] > jobs[-1] for r in answered()[len(first):])
    eagle3_gpu.install([out], None)
    with gzip.open(own / "magpie-001.jsonl.gz", "rt") as f:
        assert [json.loads(line)["job"] for line in f] == [r["job"] for r in answered()]


def test_a_slimmed_head_keeps_the_units_that_matter_and_the_commonest_draft_tokens(tmp_path):
    """slim_eagle3 (a smaller head cut out of a trained one, then trained on): the MLP units it drops are those whose
    output is smallest (here: units whose down column is zero, so the cut MLP computes exactly what the whole one
    did); the draft vocabulary keeps the tokens commonest in the training answers, EOS always, ascending; every
    other weight is copied."""
    from infer.model.draft_heads import Eagle3Head

    path = make_tiny_llama(tmp_path / "m", "gqa", seed=0)
    model = load_model(path)
    model.capture_layers((0, 1))
    V, eos = model.config.vocab_size, model.config.eos_token_ids[0]
    answers = [[7] * 5 + [8] * 4 + [9] * 3 + [10] * 2 + [11], [7, 8, 12, 13, 9]]
    rows = [{"job": i, "prompt_ids": [3, 4, 5], "answer_ids": a} for i, a in enumerate(answers)]
    items, _ = eagle3_gpu.teacher(path, rows, "cpu", batch=2, layers=(0, 1), maxlen=64)
    ids = sorted({eos, *range(3, 20)})
    torch.manual_seed(0)
    head = Eagle3Head(model.config, (0, 1), ids, intermediate_size=16)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    dead = torch.tensor([0, 3, 4, 6, 9, 10, 13, 15])
    with torch.no_grad():
        head.layer.mlp.down_proj.weight[:, dead] = 0
    sub_index = eagle3_gpu.column_index(torch.tensor(ids), torch.empty(V, dtype=torch.long))
    small = eagle3_gpu.slim_eagle3(head, model.embed_tokens, sub_index, items, model.config, mlp=8, vocab=4, seed=0)

    assert small.config.intermediate_size == 8 and small.aux_layers == (0, 1)
    assert small.draft_ids.tolist() == sorted({eos, 7, 8, 9})  # 7, 8, 9 the commonest answer tokens, EOS kept
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(small.layer.mlp(x), head.layer.mlp(x), atol=1e-5)
        cols = torch.tensor([ids.index(t) for t in small.draft_ids.tolist()])
        assert torch.equal(small.lm_head.weight, head.lm_head.weight[cols])
    big = head.state_dict()
    for k, v in small.state_dict().items():
        if not k.startswith(("layer.mlp.", "lm_head.", "draft_ids")):
            assert torch.equal(v, big[k]), k
