"""Schemathesis over every route of the live server (uvicorn on 127.0.0.1, a tiny speculating checkpoint): requests
generated from the server's own OpenAPI schema, valid and invalid, must never get a 5xx and every answer must match
the schema (status code, content type, body, Allow on a 405). Bounded: a few dozen examples per operation and mode.

Driven through schemathesis's Python API (an operation's Hypothesis strategy) rather than its pytest plugin, whose
collection hooks do not follow pytest 9.2.

Left out: schemathesis's "schema-valid request rejected" check. The schema cannot say that a prompt must be
non-empty or fit the context, so a schema-valid request can rightly get a 400 naming the problem."""

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.server import build_app
from infer.server.thread import ServerThread

EXAMPLES = 25


@pytest.fixture(scope="module")
def live(ckpt_dirs):
    # an unbounded queue: a fuzzed request of many prompts x n choices is served, not refused with a 503 (a full
    # queue's 503 is tested in test_server_routes.py). A short context: a chat request without max_tokens fills it, and
    # n = 15 such choices of 256 tokens took longer than a request's 10 s timeout on a loaded CI machine.
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=2,
                                      max_batch_size=4, block_size=4, max_seq_len=64))
    with ServerThread(build_app(engine, "tiny", max_body_bytes=64 << 10)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


def test_no_5xx_and_every_answer_matches_the_schema(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    seen: collections.Counter = collections.Counter()  # (path, status) the fuzzer got
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {o.path for o in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                                            "/health", "/metrics"}
    for operation in operations:
        # valid requests everywhere, invalid ones where there is something to get wrong (a body)
        modes = list(schemathesis.GenerationMode) if "requestBody" in operation.definition.raw else \
            [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def fuzz(case):
                response = case.call_and_validate(base_url=live.url, excluded_checks=[positive_data_acceptance])
                seen[case.path, response.status_code] += 1

            fuzz()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):  # each reached the generation routes
        assert seen[path, 200] > 0 and seen[path, 400] > 0, (path, sorted(seen.items()))
    assert not any(status >= 500 for _, status in seen)
