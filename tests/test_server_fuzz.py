"""Schemathesis over every route of the live server (uvicorn on 127.0.0.1, a tiny speculating checkpoint): requests
generated from the server's own OpenAPI schema, valid and invalid, must never get a 5xx and every answer must match
the schema (status code, content type, body, Allow on a 405). Bounded: a few dozen examples per operation.

Left out: schemathesis's "schema-valid request rejected" check. The schema cannot say that a model id must be the
served one or a prompt non-empty, so a schema-valid request can rightly get a 400 or 404 naming the problem."""

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.server import build_app
from infer.server.thread import ServerThread


@pytest.fixture(scope="module")
def live(ckpt_dirs):
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=2,
                                      max_batch_size=4, block_size=4, max_waiting_requests=64))
    with ServerThread(build_app(engine, "tiny", max_body_bytes=64 << 10)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    schema.config.update(base_url=live.url)
    schema.config.generation.update(modes=list(schemathesis.GenerationMode))  # valid and invalid requests
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")
SEEN: collections.Counter = collections.Counter()  # status codes the fuzzer got, by route


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_every_answer_matches_the_schema(case, live):
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    SEEN[case.path, response.status_code] += 1


def test_the_fuzzer_sent_valid_and_invalid_requests():
    """(Runs after the fuzzing above.) Both kinds reached the generation routes: some served, some refused."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert SEEN[path, 200] > 0 and SEEN[path, 400] > 0, SEEN
