"""The `infer` command line: a real subprocess, output and one-line errors.

Bad input is refused before a model is loaded, so those cases call ``cli.main`` in this process (``run_here``): the
same code a subprocess would run after ~5 s of imports, its exit status and stderr checked the same way."""

import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from infer import cli, progress


def run(*args):
    return subprocess.run([sys.executable, "-m", "infer", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def run_here(capsys, monkeypatch):
    """``run`` for bad input, in this process: (returncode, stdout, stderr) as a CompletedProcess names them."""
    def call(*args, input=""):
        monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(input))
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        finally:
            progress.disable()  # main enables the start-up lines for the process; the library stays silent
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return call


def test_generate_greedy(gqa_dir):
    from infer import LLM, SamplingParams

    r = run("generate", "--model", str(gqa_dir), "--prompt", "def fib", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    expected = LLM(gqa_dir).generate(["def fib"], SamplingParams(temperature=0, max_tokens=8))[0].text
    assert r.stdout == "def fib" + expected + "\n"
    assert "tok/s" in r.stderr


def test_errors_are_one_clear_line(gqa_dir, run_here):
    r = run("generate", "--model", "/no/such/dir", "--prompt", "x")  # one real process: nothing but the line
    assert r.returncode == 2 and r.stderr.strip() == "infer: error: model directory '/no/such/dir' does not exist"
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr and "Traceback" not in r.stderr
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--seed", "abc")  # words, not Python's types
    assert r.returncode == 2 and "argument --seed: expected 'none' or an integer, got 'abc'" in r.stderr
    # an address the server cannot listen on: said before the model loads, naming it (uvicorn's line did not)
    r = run_here("serve", "--model", str(gqa_dir), "--host", "999.1.1.1")
    assert r.returncode == 2 and "--host '999.1.1.1' is not an address to listen on" in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_here("serve", "--model", str(gqa_dir), "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr


def test_speculative_generate_with_debug_view(gqa_dir, run_here):
    r = run("generate", "--model", str(gqa_dir), "--draft-model", str(gqa_dir), "--prompt", "def fib",
            "--max-tokens", "8", "--temperature", "0", "--spec-length", "3", "--debug")
    assert r.returncode == 0, r.stderr
    assert "round   1 K=3 accepted 3/3" in r.stdout and "-> bonus" in r.stdout  # self-drafting accepts all
    assert "acceptance 1.00" in r.stderr
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--debug")
    assert r.returncode == 2 and "needs --draft-model" in r.stderr


def test_chat_streams_replies_and_resets(gqa_dir, run_here):
    """`infer chat` on piped input: two turns, /reset, an unknown command; each reply ends with its figures."""
    r = subprocess.run([sys.executable, "-m", "infer", "chat", "--model", str(gqa_dir), "--temperature", "0",
                        "--max-tokens", "6", "--draft-model", str(gqa_dir), "--spec-length", "2"],
                       input="hello there\n/nope\n/help\n/reset\nsecond turn\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"infer chat with {gqa_dir.name} (float32, speculating: draft + {gqa_dir.name})" in r.stdout
    assert r.stdout.count("commands: /reset") == 3  # the banner, /nope's answer, /help's
    assert r.stdout.count("tokens,") == 2 and r.stdout.count("drafts accepted") == 2
    assert "[conversation reset]" in r.stdout and "unknown command '/nope'" in r.stdout
    r = run_here("chat", "--model", str(gqa_dir), "--quantization", "int9")
    assert r.returncode == 2 and "int9" in r.stderr and "Traceback" not in r.stderr


def test_generate_and_chat_with_structured_output(gqa_dir, tmp_path, run_here):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], '
                      '"additionalProperties": false}')
    # generate in this process (run_here: cli.main, as a subprocess runs it; test_generate_greedy runs a real one)
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--max-tokens", "16", "--json-schema",
                 str(schema), "--draft-model", str(gqa_dir), "--spec-length", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.removeprefix("x").strip() in ('{"a":1}', '{"a":2}'), r.stdout
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--max-tokens", "4", "--choice", "yes",
                 "--choice", "no", "--temperature", "1")
    assert r.returncode == 0 and r.stdout.removeprefix("x").strip() in ("yes", "no"), (r.stdout, r.stderr)
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--regex", "(unclosed")
    assert r.returncode == 2 and "invalid regex" in r.stderr and "Traceback" not in r.stderr
    r = run_here("generate", "--model", str(gqa_dir), "--prompt", "x", "--regex", "a", "--choice", "b")
    assert r.returncode == 2 and "exactly one" in r.stderr
    # in this process too: `chat` takes sys.stdin / sys.stdout as they are when it runs (a default bound at import
    # wrote to an earlier test's closed capture: "I/O operation on closed file")
    r = run_here("chat", "--model", str(gqa_dir), "--temperature", "0", "--max-tokens", "12", "--regex", "[0-9]{3}",
                 input="a number\n")
    assert r.returncode == 0, r.stderr
    import re
    assert re.search(r"\b[0-9]{3}\b", r.stdout), r.stdout
