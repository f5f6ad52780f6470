"""Anthropic's Messages API (/v1/messages) through the `anthropic` SDK: the answer is the library's chat answer for
the same conversation (system prompt first), whole or streamed as Anthropic's events, with its stop_reason and usage;
a forced tool's call is the library's answer constrained by its schema, as tool_use blocks; a tool's history reaches
the template as OpenAI's; a last assistant message is continued; output_config.format constrains the text; what the
model cannot do is a 400 naming it; the SDK's x-api-key authenticates."""

import json

import anthropic
import jsonschema
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


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME, "cache_control": {"type": "ephemeral"}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_named_tool_is_one_tool_use_block_the_library_constrains_alike(client, llm):
    """tool_choice {"type": "tool"}: one tool_use block whose input follows the tool's schema, greedy the library's
    answer under that schema; streamed, the SDK assembles the same block from input_json_delta events."""
    ref = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=60, structured={"json_schema": WEATHER}),
                   tools=OPENAI_TOOLS)
    kw = dict(model=NAME, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
              extra_body=GREEDY)
    got = client.messages.create(**kw)
    (block,) = got.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input == json.loads(ref.text) and got.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER)
    with client.messages.stream(**kw) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        final = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", block.input)]
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("one", [False, True])
def test_any_tool_answers_tool_use_blocks_of_the_tools(client, one):
    """tool_choice {"type": "any"}: one or more calls (one with disable_parallel_tool_use), each a tool's name and an
    input its schema allows; streamed, the same blocks (greedy)."""
    kw = dict(model=NAME, max_tokens=120, messages=[{"role": "user", "content": "Weather and time?"}], tools=TOOLS,
              tool_choice={"type": "any", "disable_parallel_tool_use": one}, extra_body=GREEDY)
    got = client.messages.create(**kw)
    calls = [b for b in got.content if b.type == "tool_use"]
    if got.stop_reason != "max_tokens" or one:  # a random model may list calls past max_tokens
        assert got.stop_reason == "tool_use" and calls and len(calls) == len(got.content)
    assert len(calls) <= (120 if not one else 1)
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    for b in calls:
        jsonschema.validate(b.input, schemas[b.name])
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in calls]
    assert final.stop_reason == got.stop_reason


def test_a_tool_history_is_the_openai_one_to_the_template(client, llm):
    """An assistant's tool_use and the user's tool_result read as OpenAI's assistant tool_calls and tool message:
    the same prompt (count_tokens), the same greedy answer (tool_choice none)."""
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "C"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "SUNNY-21"}]}, {"type": "text", "text": "And so?"}]}]
    openai = ASK + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "SUNNY-21"}, {"role": "user", "content": "And so?"}]
    want = llm.chat(openai, SamplingParams(temperature=0, max_tokens=8), tools=OPENAI_TOOLS)
    count = client.messages.count_tokens(model=NAME, messages=history, tools=TOOLS)
    assert count.input_tokens == len(want.prompt_token_ids)
    assert "SUNNY-21" in llm.get_tokenizer().decode(want.prompt_token_ids)
    got = client.messages.create(model=NAME, max_tokens=8, messages=history, tools=TOOLS,
                                 tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == want.outputs[0].text


def test_a_last_assistant_message_is_continued(client, llm):
    """Anthropic's prefill: the answer continues the assistant's last message (the library's
    continue_final_message), its content the continuation alone."""
    conv = ASK + [{"role": "assistant", "content": "The weather"}]
    want = llm.chat(conv, SamplingParams(temperature=0, max_tokens=10), add_generation_prompt=False,
                    continue_final_message=True)
    got = client.messages.create(model=NAME, max_tokens=10, messages=conv, extra_body=GREEDY)
    assert got.content[0].text == want.outputs[0].text
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert client.messages.count_tokens(model=NAME, messages=conv).input_tokens == len(want.prompt_token_ids)


def test_output_config_format_is_structured_output(client, llm):
    want = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=60, structured={"json_schema": WEATHER}))
    got = client.messages.create(model=NAME, max_tokens=60, messages=ASK, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}})
    assert got.content[0].text == want.outputs[0].text
    jsonschema.validate(json.loads(got.content[0].text), WEATHER)


def test_what_it_cannot_do_is_refused_by_name(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    cases = [(dict(tools=TOOLS), "needs a parser of the model's own call format"),
             (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}], tool_choice={"type": "any"}),
              "a server tool"),
             (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "not among the tools"),
             (dict(tool_choice={"type": "any"}), "needs tools"),
             (dict(tools=[{"name": "f"}], tool_choice={"type": "any"}), "input_schema"),
             (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
              "belongs in an assistant message"),
             (dict(tools=TOOLS, tool_choice={"type": "any"}, messages=ASK + [
                 {"role": "assistant", "content": "{"}]), "continued"),
             (dict(tools=TOOLS, tool_choice={"type": "any"}, extra_body={"output_config": {"format": {
                 "type": "json_schema", "schema": WEATHER}}}), "not both"),
             (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "does not reason"),
             (dict(extra_body={"output_config": {"effort": "high"}}), "does not reason"),
             (dict(messages=[{"role": "user", "content": [image]}]), "reads text only, not 'image'"),
             (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                           "content": [image]}]}]), "reads text only, not 'image'"),
             (dict(model="other"), "does not exist"), (dict(max_tokens=0), "max_tokens")]
    for change, why in cases:
        kw = {**dict(model=NAME, max_tokens=4, messages=TALK), **change}
        with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError), match=why):
            client.messages.create(**kw)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=4, messages=TALK)
