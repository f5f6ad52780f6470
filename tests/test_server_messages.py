"""Anthropic's Messages API (/v1/messages) through the `anthropic` SDK: the answer is the library's chat answer for
the same conversation (system prompt first), whole or streamed as Anthropic's events, with its stop_reason and usage;
what the model cannot do is a 400 naming it; the SDK's x-api-key authenticates."""

import anthropic
import pytest

from infer import LLM, SamplingParams
from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.server import build_app
from infer.server.thread import ServerThread

NAME, KEY = "tiny", "secret"
TALK = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "please."}]}]
SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # the API's field; the SDK (2.x) no longer has an argument for it


@pytest.fixture(scope="module")
def server(ckpt_dirs):
    # a speculating target: the answers must still be the plain library's (greedy)
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                                      max_batch_size=2, block_size=4))
    with ServerThread(build_app(engine, NAME, api_key=KEY)) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(ckpt_dirs):
    return LLM(ckpt_dirs["gqa"])


def _want(llm, max_tokens, stop=None):
    conv = [{"role": "system", "content": SYSTEM}] + [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
         "".join(b["text"] for b in m["content"])} for m in TALK]
    return llm.chat(conv, SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop))


def test_a_message_is_the_librarys_chat_answer(client, llm):
    want = _want(llm, 12)
    got = client.messages.create(model=NAME, max_tokens=12, system=SYSTEM, messages=TALK, extra_body=GREEDY)
    assert got.type == "message" and got.role == "assistant" and got.model == NAME and got.id.startswith("msg")
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == want.outputs[0].text
    assert got.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert got.usage.output_tokens == len(want.outputs[0].token_ids)
    count = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=TALK)
    assert count.input_tokens == len(want.prompt_token_ids)
    # a budget past the context (Anthropic's clients ask for thousands) stops where the context ends
    assert llm.engine.max_seq_len < 4096
    room = client.messages.create(model=NAME, max_tokens=4096, system=SYSTEM, messages=TALK, extra_body=GREEDY)
    assert room.usage.input_tokens + room.usage.output_tokens <= llm.engine.max_seq_len


def test_a_streamed_message_is_the_same_answer_in_anthropics_events(client, llm):
    want = _want(llm, 12)
    with client.messages.stream(model=NAME, max_tokens=12, system=SYSTEM, messages=TALK, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == want.outputs[0].text
    assert final.usage.output_tokens == len(want.outputs[0].token_ids)
    assert final.stop_reason in ("max_tokens", "end_turn")


def test_a_stop_sequence_is_named(client, llm):
    free = _want(llm, 16).outputs[0].text
    stop = free.strip()[2:5]  # a piece of the free answer, after its start
    assert stop and stop in free
    want = _want(llm, 16, stop=[stop])
    got = client.messages.create(model=NAME, max_tokens=16, system=SYSTEM, messages=TALK, extra_body=GREEDY,
                                 stop_sequences=[stop])
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == want.outputs[0].text and stop not in got.content[0].text


def test_what_it_cannot_do_is_refused_by_name(client, server):
    cases = [(dict(tools=[{"name": "f", "input_schema": {"type": "object"}}]), "no tool use on /v1/messages"),
             (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "does not reason"),
             (dict(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
              "no structured output on /v1/messages"),
             (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
                 "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), "reads text only, not 'image'"),
             (dict(model="other"), "does not exist"), (dict(max_tokens=0), "max_tokens")]
    for change, why in cases:
        kw = {**dict(model=NAME, max_tokens=4, messages=TALK), **change}
        with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError), match=why):
            client.messages.create(**kw)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=4, messages=TALK)
