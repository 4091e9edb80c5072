"""OpenAI API details of `quasar serve` that a malformed-request sweep found missing: an
unknown model, a deeply nested body, `logprobs` / `top_logprobs`, `n > 1`, and the
engine's gauges in `/metrics`. Through the real `openai` client or raw HTTP, against a
server on loopback serving a tiny random model (the real SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from conftest import make_tiny_model  # noqa: E402
from test_server import USER, assert_error_shape, client, raw  # noqa: E402

from quasar.api import LLM  # noqa: E402
from quasar.server.app import BackgroundServer, create_app  # noqa: E402
from quasar.server.openai_schema import MAX_JSON_DEPTH  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("serve-api") / "tiny", "llama", default_model_dir, 0)


@pytest.fixture(scope="module")
def llm(model_dir):
    threads = torch.get_num_threads()
    yield LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=512, threads=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, max_queue=4, model_name="tiny")) as srv:
        yield srv


# --------------------------------------------------------------------------- model names

def test_an_unknown_model_is_404_model_not_found(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    for call in (lambda m: c.chat.completions.create(model=m, messages=USER, max_tokens=2),
                 lambda m: c.completions.create(model=m, prompt="Hello", max_tokens=2),
                 lambda m: c.models.retrieve(m)):
        with pytest.raises(openai.NotFoundError) as e:
            call("gpt-4o")
        assert e.value.status_code == 404
        assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
        assert e.value.body["param"] == "model" and "gpt-4o" in e.value.body["message"]
    # the listed id is served, and so is a request that names no model
    assert c.chat.completions.create(model="tiny", messages=USER, max_tokens=2).model == "tiny"
    status, _, body = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 2}))
    assert status == 200 and json.loads(body)["model"] == "tiny"


# --------------------------------------------------------------------------- nesting

def test_a_deeply_nested_body_is_400(server):
    deep = '{"model": "tiny", "prompt": "Hi", "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    status, _, body = raw(server, "POST", "/v1/completions", deep, {"Content-Type": "application/json"})
    assert status == 400
    err = assert_error_shape(body, code="invalid_json")
    assert "nested" in err["message"] and str(MAX_JSON_DEPTH) in err["message"]
    # below the interpreter's recursion limit, the explicit bound still holds
    just_over = {"prompt": "Hi", "extra": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}
    status, _, body = raw(server, "POST", "/v1/completions", json.dumps(just_over))
    assert status == 400 and "nested" in assert_error_shape(body, code="invalid_json")["message"]
    at_limit = {"prompt": "Hi", "max_tokens": 1, "extra": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    assert raw(server, "POST", "/v1/completions", json.dumps(at_limit))[0] == 200
