"""/v1/responses end to end with the official openai client (``client.responses``): a text answer as the library's
chat answers it, streamed as OpenAI's typed events (the SDK's own accumulator reads them back), instructions and
input items, structured output, tool calls (named and required, streamed too) and a call's history, logprobs, the
store (continued, read, listed, deleted), background responses (polled, streamed again, cancelled), truncation "auto",
the input's token count (``responses.input_tokens.count``), and the 400s naming what cannot be answered."""

import json
import time
import urllib.request

import jsonschema
import openai
import pytest

from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.llm import LLM
from infer.sampling import SamplingParams
from infer.server import build_app
from infer.server.thread import ServerThread

NAME = "tiny-responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}]
GREEDY = dict(temperature=0, max_output_tokens=12)


@pytest.fixture(scope="module")
def srv(ckpt_dirs):
    # a speculating engine: target gqa, drafter mha (the same tokenizer, other weights: real rejections)
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                                      max_batch_size=4, block_size=4))
    with ServerThread(build_app(engine, NAME)) as s:
        s.client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        yield s
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(ckpt_dirs):
    return LLM(ckpt_dirs["gqa"])


def _ref(llm, messages, **kw):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=GREEDY["max_output_tokens"], **kw))


def test_a_text_answer_is_the_library_chat_answer(srv, llm):
    r = srv.client.responses.create(model=NAME, input="Say something.", **GREEDY)
    ref = _ref(llm, [{"role": "user", "content": "Say something."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == ref.text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    want = "incomplete" if ref.finish_reason == "length" else "completed"
    assert r.status == want and (want == "completed" or r.incomplete_details.reason == "max_output_tokens")
    assert r.usage.input_tokens == len(ref.prompt_token_ids) and r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.store is True


def test_the_sampling_fields_chat_takes_are_served_too(srv, llm):
    """vLLM's sampling extensions (here bad_words, top_k, stop) act as in the library, not dropped in silence."""
    free = _ref(llm, [{"role": "user", "content": "Say something."}])
    word = next(w for w in (llm.get_tokenizer().decode([t]).strip() for t in free.token_ids) if w)
    # top_k 1 at temperature 0.9 is the argmax: dropped, the answer would be drawn
    for extra in ({"bad_words": [word]}, {"seed": 7, "top_k": 1, "stop": [free.text[3:5]]}):
        r = srv.client.responses.create(model=NAME, input="Say something.", max_output_tokens=12,
                                        temperature=0 if "bad_words" in extra else 0.9, extra_body=extra)
        want = llm.chat([{"role": "user", "content": "Say something."}], SamplingParams(
            **{"temperature": 0, "max_tokens": 12, **extra}))
        assert r.output_text == want.text
    assert want.text != free.text


def test_instructions_and_input_items_are_the_chat_messages(srv, llm):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "More."}]
    r = srv.client.responses.create(model=NAME, instructions="Be brief.", input=items, **GREEDY)
    ref = _ref(llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More."}])
    assert r.output_text == ref.text and r.instructions == "Be brief."
    # OpenAI's count of the same input: the prompt's tokens, with or without the model's id (optional there)
    count = srv.client.responses.input_tokens.count(model=NAME, instructions="Be brief.", input=items)
    assert count.object == "response.input_tokens" and count.input_tokens == len(ref.prompt_token_ids)
    assert srv.client.responses.input_tokens.count(instructions="Be brief.", input=items).input_tokens == \
        len(ref.prompt_token_ids)


def test_streamed_events_carry_the_same_answer(srv):
    kw = dict(model=NAME, input="Count.", temperature=0, max_output_tokens=16)
    whole = srv.client.responses.create(**kw)
    events = list(srv.client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with srv.client.responses.stream(**kw) as stream:  # the SDK's accumulator checks every event's place
        last = list(stream)[-1]
    assert last.type == kinds[-1] and last.response.output_text == whole.output_text


def test_text_format_json_schema_is_structured_output(srv, llm):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = srv.client.responses.create(model=NAME, input="Weather?", text={"format": fmt}, temperature=0,
                                    max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.output_text == llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(
        temperature=0, max_tokens=60, structured={"json_schema": WEATHER})).text
    assert r.text.format.type == "json_schema"


def _calls(events) -> list[tuple[str, str]]:
    """A stream's function calls as (name, arguments), assembled from their argument deltas."""
    calls = {}
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            calls[e.item.id] = [e.item.name, ""]
        elif e.type == "response.function_call_arguments.delta":
            calls[e.item_id][1] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert calls[e.item_id][1] == e.arguments
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_tool_calls_are_function_call_items(srv, choice):
    kw = dict(model=NAME, input="Weather in Paris?", tools=TOOLS, tool_choice=choice, temperature=0,
              max_output_tokens=120, parallel_tool_calls=False)
    r = srv.client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].status in ("completed", "incomplete")
    if r.status == "completed":
        schema = {t["name"]: t["parameters"] for t in TOOLS}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), schema)
    if choice != "required":
        assert calls[0].name == "get_weather" and not [o for o in r.output if o.type == "message"]
    assert _calls(srv.client.responses.create(**kw, stream=True)) == [(calls[0].name, calls[0].arguments)]


def test_a_call_and_its_output_in_input_are_the_chat_history(srv):
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris","unit":"C"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "SUNNY-21"}]
    r = srv.client.responses.create(model=NAME, input=items, tools=TOOLS, tool_choice="none", **GREEDY)
    chat = srv.client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=GREEDY["max_output_tokens"], tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "SUNNY-21"}])
    assert r.output_text == chat.choices[0].message.content


def test_a_stored_response_is_read_continued_and_deleted(srv, llm):
    """store (OpenAI's default): GET returns the response as answered; previous_response_id continues its
    conversation (the library's chat of the whole history, whose instructions are not carried over, OpenAI's rule),
    streamed or not, through a call and its output too; DELETE drops it; store false keeps nothing."""
    first = srv.client.responses.create(model=NAME, input="Say something.", instructions="Be brief.", **GREEDY)
    assert srv.client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = srv.client.responses.create(model=NAME, input="And again?", previous_response_id=first.id, **GREEDY)
    history = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And again?"}]
    assert second.previous_response_id == first.id and second.output_text == _ref(llm, history).text
    events = list(srv.client.responses.create(model=NAME, input="Once more.", previous_response_id=second.id,
                                              stream=True, **GREEDY))
    third = events[-1].response  # response.completed, or .incomplete at max_output_tokens
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."}]
    assert third.output_text == _ref(llm, history).text
    assert srv.client.responses.retrieve(third.id).output_text == third.output_text  # a stream's is kept too
    # a call's turn: its function_call item is the assistant message whose output the next input answers
    call = srv.client.responses.create(model=NAME, input="Weather?", tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=120)
    (fc,) = [o for o in call.output if o.type == "function_call"]
    after = srv.client.responses.create(model=NAME, previous_response_id=call.id, tools=TOOLS, tool_choice="none",
                                        input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                "output": "SUNNY-21"}], **GREEDY)
    chat = srv.client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=GREEDY["max_output_tokens"], tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": fc.call_id, "type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]},
                  {"role": "tool", "tool_call_id": fc.call_id, "content": "SUNNY-21"}])
    assert after.output_text == chat.choices[0].message.content
    gone = srv.client.responses.delete(first.id)
    assert gone is None or getattr(gone, "deleted", True)
    for rid in (first.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            srv.client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):  # what continued it is still there; the first is not
        srv.client.responses.create(model=NAME, input="x", previous_response_id=first.id, **GREEDY)
    assert srv.client.responses.retrieve(second.id).id == second.id
    unstored = srv.client.responses.create(model=NAME, input="Hi", store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        srv.client.responses.retrieve(unstored.id)


def test_a_stored_responses_input_items_are_listed(srv):
    """GET /v1/responses/{id}/input_items (the SDK's input_items.list): the response's own input as OpenAI's items,
    newest first by default, in pages the SDK's cursor follows (``after``, ``has_more``)."""
    items = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris","unit":"C"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "SUNNY-21"}]
    r = srv.client.responses.create(model=NAME, input=items, **GREEDY)
    newest = list(srv.client.responses.input_items.list(r.id, limit=3))  # two pages: 3, then 1
    assert [i.type for i in newest] == ["function_call_output", "function_call", "message", "message"]
    oldest = list(srv.client.responses.input_items.list(r.id, order="asc"))
    assert [i.id for i in oldest] == [i.id for i in reversed(newest)] and len({i.id for i in oldest}) == 4
    assert oldest[0].role == "system" and oldest[0].content[0].text == "Be brief."
    assert oldest[1].role == "user" and oldest[1].content[0].type == "input_text"
    assert (oldest[2].name, oldest[2].call_id, oldest[3].output) == ("get_weather", "call_1", "SUNNY-21")
    page = srv.client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.id for i in page.data] == [i.id for i in oldest[:2]] and page.has_more
    (only,) = srv.client.responses.input_items.list(srv.client.responses.create(model=NAME, input="Hi", **GREEDY).id)
    assert only.role == "user" and only.content[0].text == "Hi"
    with pytest.raises(openai.NotFoundError):
        srv.client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.responses.input_items.list(r.id, after="msg_nope")
    assert e.value.body["param"] == "after"


def test_the_store_keeps_the_last_responses():
    from infer.server.response_store import ResponseStore, Stored

    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", Stored({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r2").response == {"id": "r2"} and len(store) == 2
    assert store.delete("r1") and not store.delete("r1")
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(capacity=0)

    class Job:  # a background response's job, as the store sees it
        done, cancelled, task = False, False, None

        def cancel(self):
            self.cancelled = True

    jobs = [Job(), Job(), Job()]
    for i, job in enumerate(jobs):
        store.put(f"b{i}", Stored({"id": f"b{i}"}, [], job))
    assert jobs[0].cancelled and not jobs[1].cancelled  # dropped while it ran: nobody could reach it
    store.update("b0", Stored({"id": "b0", "status": "cancelled"}, [], jobs[0]))  # its end: not stored again
    assert store.get("b0") is None and store.get("b2").running
    assert store.delete("b1") and jobs[1].cancelled
    jobs[2].done = True
    assert not store.get("b2").running and store.cancel_all() == [] and not jobs[2].cancelled


def test_logprobs_when_included(srv):
    r = srv.client.responses.create(model=NAME, input="Hi", include=["message.output_text.logprobs"],
                                    top_logprobs=2, **GREEDY)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps).startswith(r.output_text[:1])
    assert all(lp.logprob <= 0 and lp.top_logprobs[0].logprob >= lp.logprob for lp in lps)  # greedy: the top


def _settled(srv, rid, timeout=60.0):
    """The background response once its job has ended (polled, as OpenAI's guide does)."""
    deadline = time.monotonic() + timeout
    while (r := srv.client.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{rid} still {r.status} after {timeout} s"
        time.sleep(0.02)
    return r


def _idle(srv, timeout=10.0):
    """True once the engine holds no request (/metrics' gauges): what was cancelled has been aborted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"{srv.url}/metrics").read().decode()
        if "infer_requests_running 0.0" in text and "infer_requests_waiting 0.0" in text:
            return True
        time.sleep(0.02)
    return False


def test_a_background_response_is_polled_streamed_again_and_continued(srv, llm):
    """background (store's): the POST answers at once ("queued", no output); polled, the response ends as the same
    request answered in the foreground; its events stream again from the start or after any sequence number (the
    SDK's own types read them), or at once; previous_response_id continues it."""
    r = srv.client.responses.create(model=NAME, input="Say something.", background=True, **GREEDY)
    assert r.background is True and r.status in ("queued", "in_progress") and r.output == []
    done = _settled(srv, r.id)
    ref = _ref(llm, [{"role": "user", "content": "Say something."}])
    assert done.output_text == ref.text and done.usage.output_tokens == len(ref.token_ids)
    assert done.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    events = list(srv.client.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[-1].response.model_dump() == done.model_dump()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref.text
    later = list(srv.client.responses.retrieve(r.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in later] == [e.model_dump() for e in events[4:]]
    streamed = list(srv.client.responses.create(model=NAME, input="Say something.", background=True, stream=True,
                                                **GREEDY))
    assert streamed[0].response.status == "queued" and streamed[-1].response.output_text == ref.text
    assert srv.client.responses.retrieve(streamed[-1].response.id).output_text == ref.text
    after = srv.client.responses.create(model=NAME, input="And again?", previous_response_id=r.id, **GREEDY)
    history = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": ref.text},
               {"role": "user", "content": "And again?"}]
    assert after.output_text == _ref(llm, history).text


def test_a_background_response_is_cancelled_with_what_it_wrote(srv):
    """cancel stops the job (its engine request aborted) and stores it "cancelled" with the output it had; while it
    runs it cannot be continued; cancelling again returns it as it ended; delete cancels too. A foreground response
    cannot be cancelled or streamed again, and background needs store."""
    long = dict(temperature=0, max_output_tokens=200, extra_body={"ignore_eos": True})
    stream = srv.client.responses.create(model=NAME, input="Count.", background=True, stream=True, **long)
    events = iter(stream)
    rid = next(events).response.id
    next(e for e in events if e.type == "response.output_text.delta")  # running: its first text is out
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.responses.create(model=NAME, input="x", previous_response_id=rid, **GREEDY)
    assert e.value.body["param"] == "previous_response_id" and "still running" in e.value.body["message"]
    cancelled = srv.client.responses.cancel(rid)
    stream.close()
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 200
    (item,) = cancelled.output
    assert item.status == "incomplete" and cancelled.output_text and _idle(srv)
    assert srv.client.responses.retrieve(rid).model_dump() == cancelled.model_dump()
    assert srv.client.responses.cancel(rid).model_dump() == cancelled.model_dump()
    gone = srv.client.responses.create(model=NAME, input="Count.", background=True, **long)
    srv.client.responses.delete(gone.id)
    assert _idle(srv)
    with pytest.raises(openai.NotFoundError):
        srv.client.responses.retrieve(gone.id)
    foreground = srv.client.responses.create(model=NAME, input="Hi", **GREEDY)
    for call, param in ((lambda: srv.client.responses.cancel(foreground.id), "response_id"),
                        (lambda: list(srv.client.responses.retrieve(foreground.id, stream=True)), "stream"),
                        (lambda: srv.client.responses.create(model=NAME, input="x", background=True, store=False),
                         "background")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, e.value.body


def test_truncation_auto_drops_the_oldest_turns_to_fit(srv, llm):
    """truncation "auto": a conversation longer than the context loses its oldest turns (the instructions stay) until
    it fits with max_output_tokens; the answer is the library's chat of what was kept. Without it: a 400."""
    turns = [m for i in range(8) for m in ({"role": "user", "content": f"Question {i}: " + "word " * 12},
                                            {"role": "assistant", "content": f"Answer {i}: " + "more " * 12})]
    turns.append({"role": "user", "content": "Last question?"})
    system = [{"role": "system", "content": "Be brief."}]
    tok = llm.tokenizer
    assert len(tok.apply_chat_template(system + turns)) > 256 - GREEDY["max_output_tokens"]  # the context: 256
    keep = next(k for k in range(0, len(turns), 2)
                if len(tok.apply_chat_template(system + turns[k:])) <= 256 - GREEDY["max_output_tokens"])
    r = srv.client.responses.create(model=NAME, input=turns, instructions="Be brief.", truncation="auto", **GREEDY)
    ref = _ref(llm, system + turns[keep:])
    assert 0 < keep < len(turns) - 1 and r.truncation == "auto"
    assert r.output_text == ref.text and r.usage.input_tokens == len(ref.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.responses.create(model=NAME, input=turns, instructions="Be brief.", **GREEDY)
    assert "exceeds" in e.value.body["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"previous_response_id": "resp_1"}, 404, "previous_response_id"),  # none stored by that id
    ({"truncation": "middle"}, 400, "truncation"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"tools": TOOLS}, 400, "tool_choice"),  # "auto" without the server's --tool-call-parser
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"model": "nope"}, 404, "model"),
])
def test_requests_that_cannot_be_answered_name_the_field(srv, body, status, param):
    with pytest.raises(openai.APIStatusError) as e:
        srv.client.responses.create(**{"model": NAME, "input": "x", "max_output_tokens": 2, **body})
    assert e.value.status_code == status and param in (e.value.body.get("param") or ""), e.value.body
