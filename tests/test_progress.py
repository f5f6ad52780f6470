"""Start-up progress lines: what a background stage may print while a reply streams on the same terminal."""

import io
import threading
from types import SimpleNamespace

import pytest

from infer import progress
from infer.chat import run_chat


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def out():
    stream = Terminal()
    progress.enable(stream)
    yield stream
    progress.disable()


def in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def background_stage():
    with progress.stage("compiling the decode step"):
        pass
    progress.note("compiled steps ready: full speed from here")


def test_background_lines_wait_while_held_and_print_whole_after(out):
    with progress.held():
        with progress.held():  # nested: the outer block's end prints
            in_thread(background_stage)
        progress.note("from the main thread")  # the caller's own lines are not held
        assert out.getvalue() == "infer: from the main thread\n"
    lines = out.getvalue().splitlines()
    # the stage began and ended while held: its end line alone
    assert lines[1:] == ["infer: compiling the decode step: done after 0.0 s",
                         "infer: compiled steps ready: full speed from here"]
    in_thread(background_stage)  # not held: at once, the start line too
    assert out.getvalue().splitlines()[3:] == ["infer: compiling the decode step ...",
                                               "infer: compiling the decode step: done after 0.0 s",
                                               "infer: compiled steps ready: full speed from here"]


def test_only_the_main_thread_spins_on_a_terminal(out):
    """A spinner redraws its line (carriage return, erase) over what the chat wrote there since: a background stage
    (the warm-up compiling) on a terminal prints lines instead."""
    status = progress._spinner("building")
    assert status is not None
    status.stop()
    got = []
    in_thread(lambda: got.append(progress._spinner("compiling")))
    assert got == [None]
    out.seek(0)
    out.truncate()
    in_thread(background_stage)
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_chat_prints_a_background_line_after_the_reply_not_inside_it(out):
    """`infer chat` (and the demo) stream a reply on the terminal the warm-up reports to: a line the warm-up prints
    mid-reply comes after the reply's figures, on a line of its own."""
    def stream(ids, params):
        for i, word in enumerate(["The", " sky", " is", " blue."]):
            if i == 2:
                in_thread(background_stage)
            yield SimpleNamespace(text=word, token_id=i, finish_reason="stop" if i == 3 else None,
                                  acceptance_rate=None)

    llm = SimpleNamespace(model_path="m", stream=stream,
                          tokenizer=SimpleNamespace(has_chat_template=True,
                                                    apply_chat_template=lambda messages, **kw: [1, 2]))
    assert run_chat(llm, None, inp=io.StringIO("why?\n"), out=out) == 0
    text = out.getvalue()
    assert "The sky is blue.\n[4 tokens" in text
    reply_end = text.index("[4 tokens")
    assert text.index("infer: compiling the decode step: done") > reply_end
    assert text.index("infer: compiled steps ready") > reply_end
    assert "compiling the decode step ..." not in text


@pytest.mark.parametrize("ready", [False, True])
def test_a_reply_streamed_while_warming_up_says_so_beside_its_speed(out, ready):
    """A reply the engine ran before its compiled steps were built (eagerly or beside the compiler) must not have its
    tok/s read as the engine's speed."""
    def stream(ids, params):
        yield SimpleNamespace(text="Hi.", token_id=1, finish_reason="stop", acceptance_rate=None)

    llm = SimpleNamespace(model_path="m", stream=stream, engine=SimpleNamespace(warmup=SimpleNamespace(ready=ready)),
                          tokenizer=SimpleNamespace(has_chat_template=True,
                                                    apply_chat_template=lambda messages, **kw: [1, 2]))
    run_chat(llm, None, inp=io.StringIO("hello\n"), out=out)
    (line,) = [x for x in out.getvalue().splitlines() if x.startswith("[1 tokens")]
    assert ("still warming up" in line) == (not ready)
