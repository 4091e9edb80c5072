"""OpenAI API details of `quasar serve` that a malformed-request sweep found missing: an
unknown model, a deeply nested body, `logprobs` / `top_logprobs`, `n > 1`, and the
engine's gauges in `/metrics`. Through the real `openai` client or raw HTTP, against a
server on loopback serving a tiny random model (the real SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from test_server import USER, assert_error_shape, client, raw, wait_for  # noqa: E402

from quasar.server.app import BackgroundServer, create_app  # noqa: E402
from quasar.server.openai_schema import MAX_JSON_DEPTH  # noqa: E402


@pytest.fixture(scope="module")
def reference_logprobs(model_dir):
    """log-softmax rows of the same model run by transformers: row j scores output token j."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def rows(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
        return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)], dim=-1)

    return rows


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
    nest = MAX_JSON_DEPTH - 1  # the body object itself is the first level
    at_limit = {"prompt": "Hi", "max_tokens": 1, "extra": json.loads("[" * nest + "]" * nest)}
    assert raw(server, "POST", "/v1/completions", json.dumps(at_limit))[0] == 200


# --------------------------------------------------------------------------- logprobs

def _texts(llm, ids: list[int]) -> list[str]:
    return [llm.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def test_chat_logprobs_are_the_verifiers_log_softmax(server, llm, reference_logprobs):
    c = client(server)
    resp = c.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0, logprobs=True,
                                     top_logprobs=5)
    direct = llm.generate(USER, max_new_tokens=16)
    assert resp.choices[0].message.content == direct.text
    content = resp.choices[0].logprobs.content
    assert [e.token for e in content] == _texts(llm, direct.token_ids) and len(content) == 16
    ref = reference_logprobs(llm.encode(USER), direct.token_ids)
    for j, (e, token_id) in enumerate(zip(content, direct.token_ids)):
        assert e.logprob == pytest.approx(ref[j, token_id].item(), abs=1e-3)
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 5
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)  # greedy: the top-1
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(ref[j].topk(5).values.tolist(), abs=1e-3)
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in e.top_logprobs)

    # streamed: the chunks' entries add up to the same list
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]

    # logprobs without alternatives; and none unless asked
    plain = c.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 4
    assert c.chat.completions.create(model="tiny", messages=USER, max_tokens=4).choices[0].logprobs is None


def test_completion_logprobs_follow_the_raw_distribution_when_sampling(server, llm, reference_logprobs):
    """Sampled tokens get the verifier's raw log-softmax (before temperature), the legacy shape."""
    prompt, c = "Once upon a time", client(server)
    resp = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.9, seed=3, logprobs=2)
    direct = llm.generate(prompt, raw=True, max_new_tokens=12, temperature=0.9, seed=3)
    assert resp.choices[0].text == direct.text
    lp = resp.choices[0].logprobs
    assert lp.tokens == _texts(llm, direct.token_ids)
    ref = reference_logprobs(llm.encode(prompt, raw=True), direct.token_ids)
    assert lp.token_logprobs == pytest.approx([ref[j, t].item() for j, t in enumerate(direct.token_ids)], abs=1e-3)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the two best, and always the chosen token
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]

    streamed = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.9, seed=3,
                                         logprobs=2, stream=True))
    parts = [ch.choices[0].logprobs for ch in streamed if ch.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets run on across chunks


def test_logprobs_requests_that_are_refused(server):
    c = client(server)
    for kwargs, param in [(dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                          (dict(logprobs="yes"), "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=USER, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=6)
    assert e.value.body["param"] == "logprobs"


# --------------------------------------------------------------------------- n choices

def test_n_greedy_choices_are_identical_to_one(server):
    c = client(server)
    one = c.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=0)
    three = c.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=0, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert [ch.message.content for ch in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    assert three.model_extra["quasar"]["new_tokens"] == 3 * one.model_extra["quasar"]["new_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=USER, max_tokens=2, n=17)
    assert e.value.body["param"] == "n"


def test_n_seeded_choices_are_reproducible(server):
    c = client(server)

    def texts(n: int, seed: int) -> list[str]:
        resp = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                    seed=seed, n=n)
        return [ch.text for ch in sorted(resp.choices, key=lambda ch: ch.index)]

    first = texts(3, 11)
    assert texts(3, 11) == first
    assert first == [texts(1, 11 + i)[0] for i in range(3)]  # choice i samples with seed + i
    assert len(set(first)) > 1, "seeded choices should differ from one another"


def test_n_streamed_choices_with_logprobs(server):
    c = client(server)
    full = c.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0.8, seed=5, n=2,
                                     logprobs=True)
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0.8, seed=5, n=2,
                                            logprobs=True, stream=True, stream_options={"include_usage": True}))
    for ch in full.choices:
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].index == ch.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == ch.message.content
        assert [e.token for m in mine if m.logprobs for e in m.logprobs.content] == \
            [e.token for e in ch.logprobs.content]
        assert [m.finish_reason for m in mine if m.finish_reason] == [ch.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12


# --------------------------------------------------------------------------- gauges

def _gauge(server, name: str) -> float:
    text = raw(server, "GET", "/metrics")[2].decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_metrics_expose_waiting_running_and_batch_size(server):
    engine, c = server.app.state.scheduler, client(server)
    stream = c.chat.completions.create(model="tiny", messages=USER, max_tokens=450, temperature=0, stream=True,
                                       extra_body={"drafter": "none"})
    next(stream), next(stream)  # the role chunk, then the first text: the request is being decoded
    assert _gauge(server, "quasar_requests_running") == 1 and _gauge(server, "quasar_batch_size") == 1
    stream.close()
    assert wait_for(lambda: engine.running == 0)
    assert _gauge(server, "quasar_requests_running") == 0 and _gauge(server, "quasar_batch_size") == 0

    engine.pause()
    try:
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(c.chat.completions.create, model="tiny", messages=USER, max_tokens=2)
            assert wait_for(lambda: engine.queue_depth == 1)
            assert _gauge(server, "quasar_requests_waiting") == 1
            engine.resume()
            assert queued.result(timeout=30).usage.completion_tokens == 2
    finally:
        engine.resume()
    assert _gauge(server, "quasar_requests_waiting") == 0
