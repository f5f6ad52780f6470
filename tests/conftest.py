import copy
import os
import warnings

import pytest
import torch

from infer.model.loader import load_model
from infer.testing import SHAPES, make_tiny_llama
from infer.tokenizer import Tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
warnings.filterwarnings("ignore", message=".*generation flags.*")


@pytest.fixture(autouse=True)
def profile_dir(tmp_path, monkeypatch):
    """A fresh cost-profile store per test (spec_decode.profile_store): no test reads a profile another test, or the
    user's own runs, left in ~/.cache."""
    path = tmp_path / "profiles"
    monkeypatch.setattr("infer.spec_decode.profile_store.default_dir", lambda: path)
    monkeypatch.setattr("infer.model.gguf.cache_dir", lambda name: tmp_path / name)  # GGUF indexes too
    return path


@pytest.fixture(autouse=True)
def no_warmup_left_running():
    """A test's engines may leave a background warm-up compiling (engine.warmup); stop it at the test's end, so it
    does not take CPU from the tests after it (several time a cost model's profile)."""
    yield
    from infer.engine.warmup import stop_all

    stop_all()


@pytest.fixture(scope="session")
def ckpt_dirs(tmp_path_factory):
    """One tiny random HF checkpoint per fixture shape (mha, gqa, llama3, tied)."""
    return {shape: make_tiny_llama(tmp_path_factory.mktemp(shape), shape) for shape in SHAPES}


@pytest.fixture(scope="session")
def gqa_dir(ckpt_dirs):
    return ckpt_dirs["gqa"]


@pytest.fixture(scope="session")
def llama3_dir(ckpt_dirs):
    return ckpt_dirs["llama3"]


@pytest.fixture(scope="module")
def models(gqa_dir):
    """The gqa checkpoint as target, a drafter that resembles it (a noisy copy: acceptance in between 0 and 1), and
    the tokenizer (a module may define its own ``models``)."""
    target = load_model(gqa_dir)
    drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return target, drafter, Tokenizer(gqa_dir, extra_eos_token_ids=target.config.eos_token_ids)


@pytest.fixture(scope="session")
def hf_model():
    """Cached transformers reference models by checkpoint path."""
    from transformers import LlamaForCausalLM

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get
