"""server/tools.py alone: the plan a request's tools and tool_choice make, and the reader that turns a streamed
answer into OpenAI's tool-call deltas."""

import json

import pytest

from infer.server import protocol as P
from infer.server.errors import ApiError
from infer.server.tools import ToolCallReader, plan

TOOLS = [P.Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}}}}) for n in ("a", "b")]


def _pieces(text: str, cut: int):
    """``text`` in pieces of ``cut`` characters, as a stream delivers it."""
    return [text[i:i + cut] for i in range(0, len(text), cut)]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_required_calls_are_read_whole_wherever_the_stream_cuts_them(cut):
    # strings holding brackets, braces, escaped quotes and backslashes are text, not structure
    calls = [{"name": "a", "parameters": {"s": 'x"}'}}, {"name": "b", "parameters": {"s": ']{["\\'}},
             {"name": "a", "parameters": {"s": '\\"}\u00e9\n'}}, {"name": "b", "parameters": {}}]
    text = json.dumps(calls, separators=(",", ":"))
    reader = ToolCallReader("required")
    deltas = [reader.feed(p) for p in _pieces(text, cut)]
    got = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in got] == [0, 1, 2, 3]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == \
        [(c["name"], json.dumps(c["parameters"], ensure_ascii=False, separators=(",", ":"))) for c in calls]
    assert len({c["id"] for c in got}) == 4
    assert reader.message() == {"role": "assistant", "content": None, "tool_calls": [
        {k: c[k] for k in ("id", "type", "function")} for c in got]}
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"


def test_a_required_list_cut_short_keeps_the_calls_it_completed():
    reader = ToolCallReader("required")
    reader.feed('[{"name":"a","parameters":{"s":"1"}},{"name":"b","parameters":{"s":"unfin')
    assert [c["function"]["name"] for c in reader.message()["tool_calls"]] == ["a"]


def test_named_call_streams_its_arguments_and_its_header_once():
    reader = ToolCallReader("named", "b")
    first, second, third = reader.feed('{"s":'), reader.feed(""), reader.feed('"v"}')
    assert first["tool_calls"][0]["function"] == {"name": "b", "arguments": '{"s":'}
    assert first["tool_calls"][0]["id"].startswith("call_") and second == {}
    assert third == {"tool_calls": [{"index": 0, "function": {"arguments": '"v"}'}}]}
    assert reader.message()["tool_calls"][0]["function"]["arguments"] == '{"s":"v"}'
    assert first["tool_calls"][0]["function"]["arguments"] == '{"s":'  # a sent delta is not changed afterwards
    assert reader.finish_reason("stop") == "stop"


def test_plan_constrains_named_and_required_calls_and_refuses_auto():
    mode, spec = plan(TOOLS, P.NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}}), True)
    assert mode == "named" and spec.json_schema == TOOLS[1].function.parameters
    mode, spec = plan(TOOLS, "required", False)
    assert mode == "required" and spec.json_schema["maxItems"] == 1 and spec.json_schema["minItems"] == 1
    assert [i["properties"]["name"] for i in spec.json_schema["items"]["anyOf"]] == [{"enum": ["a"]}, {"enum": ["b"]}]
    assert plan(TOOLS, "none", True) == (None, None) and plan(None, None, True) == (None, None)
    for tools, choice in ((TOOLS, None), (TOOLS, "auto"), (None, "required")):
        with pytest.raises(ApiError) as e:
            plan(tools, choice, True)
        assert e.value.param == "tool_choice"


def _read(reader: ToolCallReader, text: str, cut: int) -> tuple[str, list[dict], list[dict]]:
    """``text`` streamed in pieces of ``cut`` characters -> (content, calls as sent, the deltas)."""
    pieces = _pieces(text, cut) or [""]
    deltas = [reader.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content = "".join(d.get("content", "") for d in deltas)
    return content, [c for d in deltas for c in d.get("tool_calls", [])], deltas


def _named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("cut", [1, 2, 5, 1000])
def test_hermes_calls_are_read_from_their_tags_and_the_rest_is_content(cut):
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"s": "</tool_call> <"}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n')
    reader = ToolCallReader("auto", parser="hermes")
    content, calls, _ = _read(reader, text, cut)
    assert content == "Let me check." and _named(calls) == [("a", {"s": "</tool_call> <"}), ("b", {})]
    message = reader.message()
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 2
    assert reader.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_hermes_text_that_is_no_call_stays_content(cut):
    for text, want in (("a < b, and <tool no", "a < b, and <tool no"),
                       ("x <tool_call>not json</tool_call>", "x <tool_call>not json</tool_call>"),
                       ("\n\nHi\n", "\n\nHi\n"), ("ends <tool_ca", "ends <tool_ca")):
        reader = ToolCallReader("auto", parser="hermes")
        content, calls, _ = _read(reader, text, cut)
        assert (content, calls) == (want, []), text
        assert reader.message() == {"role": "assistant", "content": want} and reader.finish_reason("stop") == "stop"
    reader = ToolCallReader("auto", parser="hermes")  # cut by max_tokens inside the tag: a whole object still reads
    content, calls, _ = _read(reader, '<tool_call>{"name": "a", "arguments": {"s": 1}}', cut)
    assert content == "" and _named(calls) == [("a", {"s": 1})]


@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_llama3_json_calls_open_the_answer_or_it_is_content(cut):
    reader = ToolCallReader("auto", parser="llama3_json")
    _, calls, _ = _read(reader, ' {"name": "a", "parameters": {"s": "}{"}}; {"name": "b", "parameters": {}}', cut)
    assert _named(calls) == [("a", {"s": "}{"}), ("b", {})] and reader.message()["content"] is None
    reader = ToolCallReader("auto", parser="llama3_json")
    content, calls, _ = _read(reader, ' The answer is {"x": 1}.', cut)
    assert (content, calls) == (' The answer is {"x": 1}.', []) and reader.finish_reason("stop") == "stop"
    reader = ToolCallReader("auto", parser="llama3_json")
    content, calls, _ = _read(reader, '\n{"name": "a", "parameters": {}} and {"x": 1}', cut)
    assert _named(calls) == [("a", {})] and content == ' and {"x": 1}'  # the call, and what is no call
    reader = ToolCallReader("auto", parser="llama3_json")  # JSON that is no call, and one left open: content
    content, calls, _ = _read(reader, '{"x": 1} {"name": "a", "parameters": {"s"', cut)
    assert calls == [] and content == '{"x": 1} {"name": "a", "parameters": {"s"'


def test_a_parser_needs_a_template_that_shows_the_tools(ckpt_dirs):
    from infer.tokenizer import Tokenizer

    tok = Tokenizer(ckpt_dirs["gqa"])
    assert not tok.shows_tools()  # the test template, as SmolLM2's, renders messages only
    tok.hf.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + tok.hf.chat_template
    assert tok.shows_tools()
