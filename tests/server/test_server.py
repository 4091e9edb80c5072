"""`quasar serve`: the OpenAI-compatible API, tested with the real `openai` client on loopback.

One tiny random model (the real SmolLM2 tokenizer and chat template) is shared by a few
servers started in threads on 127.0.0.1 with OS-chosen ports: `main` (no key, small
queue, a wrapper LLM that fails on request) and `keyed` (API key, one batch slot and a
queue of one).
torch runs single-threaded here: a tiny model is much faster that way on 2 shared cores.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from conftest import make_tiny_model  # noqa: E402

from quasar.api import LLM  # noqa: E402
from quasar.server.app import BackgroundServer, create_app  # noqa: E402

CONTEXT = 512
KEY = "sk-quasar-test"
FAIL_SEED = 424242  # FlakyLLM fails a request with this seed after its first verifier step
USER = [{"role": "user", "content": "Write a haiku about the sea."}]


class FlakyLLM:
    """Delegates to a real LLM, but a request with seed=FAIL_SEED fails mid-generation: its
    drafter raises after the first verifier step (the engine's other sequences go on)."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def new_drafter(self, plan):
        drafter = self._llm.new_drafter(plan)
        if plan.options.sampling.seed == FAIL_SEED:
            extend, calls = drafter.extend, []

            def failing_extend(tokens):  # the first call is the prompt, the second a step's output
                extend(tokens)
                calls.append(tokens)
                if len(calls) >= 2:
                    raise RuntimeError("injected failure")

            drafter.extend = failing_extend
        return drafter


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    threads = torch.get_num_threads()
    model_dir = make_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", "llama", default_model_dir, 0)
    llm = LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=CONTEXT, threads=1)
    yield llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def main(llm):
    with BackgroundServer(create_app(FlakyLLM(llm), max_queue=8, model_name="tiny")) as server:
        yield server


@pytest.fixture(scope="module")
def keyed(llm):
    with BackgroundServer(create_app(llm, api_key=KEY, max_queue=1, max_batch=1, model_name="tiny")) as server:
        yield server


def client(server, key: str = "unused", **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def raw(server, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of one plain HTTP request (a body is sent as JSON
    unless `headers` say otherwise)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    if headers is None:
        headers = {} if body is None else {"Content-Type": "application/json"}
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def assert_error_shape(body: bytes, code: str | None = None, param: str | None = None) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --------------------------------------------------------------------------- happy paths

def test_models_health_and_playground(main):
    models = client(main).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, headers, body = raw(main, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["max_context"] == CONTEXT
    assert health["defaults"]["drafter"] == "ngram" and health["defaults"]["verifier"] == "fp"
    status, headers, body = raw(main, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"tok-draft" in body


def test_a_chats_next_turn_starts_from_the_prompt_cache(main, llm):
    """The next turn of a chat starts from the K/V its first turn left in the prompt cache
    (usage.prompt_tokens_details.cached_tokens: on this float verifier, the first turn's
    whole 128-token prefill chunks), and its reply is the one a fresh decode gives."""
    c = client(main)
    story = [{"role": "user", "content": "Summarize: " + "The fox ran into the woods and the hounds went after it. " * 14}]
    n = len(llm.encode(story))
    assert 128 < n < 384
    one = c.chat.completions.create(model="tiny", messages=story, max_tokens=8, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    turn = story + [{"role": "assistant", "content": one.choices[0].message.content},
                    {"role": "user", "content": "Shorter, please."}]
    two = c.chat.completions.create(model="tiny", messages=turn, max_tokens=8, temperature=0)
    assert two.usage.prompt_tokens_details.cached_tokens == (n - 1) // 128 * 128
    assert two.choices[0].message.content == llm.generate(turn, max_new_tokens=8, drafter="ngram", verifier="fp").text


def test_chat_matches_the_python_api(main, llm):
    c = client(main)
    resp = c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    direct = llm.generate(USER, max_new_tokens=12, drafter="ngram", verifier="fp")
    assert choice.message.content == direct.text
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(llm.encode(USER)), 12)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    q = resp.model_extra["quasar"]
    assert q["drafter"] == "ngram" and q["verifier"] == "fp" and q["num_draft"] == 5
    assert 1 <= q["steps"] <= 12 and q["mean_accepted"] == pytest.approx(12 / q["steps"], abs=1e-3)
    assert q["tokens_per_s"] > 0

    # a request may override the speculative settings: no drafter means one token per step
    plain = c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                      extra_body={"drafter": "none"})
    assert plain.choices[0].message.content == direct.text  # greedy: drafts never change the text
    tree = c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                     extra_body={"drafter": "tree", "draft_budget": 6})
    assert tree.choices[0].message.content == direct.text
    assert tree.model_extra["quasar"]["drafter"] == "tree" and tree.model_extra["quasar"]["draft_budget"] == 6
    assert plain.model_extra["quasar"]["steps"] == 12 and plain.model_extra["quasar"]["drafter"] == "none"


def test_chat_stream_with_usage_and_draft_pieces(main):
    c = client(main)
    full = c.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["quasar"]["steps"] == full.model_extra["quasar"]["steps"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    pieces = [p for ch in chunks if "quasar" in (ch.model_extra or {}) for p in ch.model_extra["quasar"].get("pieces", [])]
    assert "".join(t for t, _ in pieces) == text
    n_draft, accepted = sum(1 for _, from_draft in pieces if from_draft), full.model_extra["quasar"]["accepted"]
    assert n_draft <= accepted and (n_draft > 0) == (accepted > 0)


def test_completions_stream_and_not(main, llm):
    c = client(main)
    resp = c.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=10, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].finish_reason == "length"
    direct = llm.generate("def fibonacci(n):", raw=True, max_new_tokens=10, drafter="ngram")
    assert resp.choices[0].text == direct.text
    assert resp.usage.prompt_tokens == len(llm.encode("def fibonacci(n):", raw=True))
    streamed = list(c.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=10, temperature=0,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == direct.text
    assert streamed[-1].choices[0].finish_reason == "length"
    # token ids as the prompt give the same result
    ids = llm.encode("def fibonacci(n):", raw=True)
    assert c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0).choices[0].text == direct.text


def test_stop_and_seeded_sampling(main):
    c = client(main)
    base = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3
    stopped = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                   stop=[words[2]]).choices[0]
    assert stopped.finish_reason == "stop" and words[2] not in stopped.text and base.startswith(stopped.text)
    a, b = (c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                 seed=7).choices[0].text for _ in range(2))
    assert a == b


# --------------------------------------------------------------------------- errors

def test_malformed_and_wrongly_typed_requests(main):
    status, _, body = raw(main, "POST", "/v1/chat/completions", b'{"messages": [', {"Content-Type": "application/json"})
    assert status == 400
    assert_error_shape(body, code="invalid_json")
    status, _, body = raw(main, "POST", "/v1/completions", b'["not", "an", "object"]')
    assert status == 400
    assert_error_shape(body, code="invalid_json")

    c = client(main)
    for kwargs, param in [(dict(max_tokens="many"), "max_tokens"), (dict(temperature="hot"), "temperature"),
                          (dict(temperature=5), "temperature"), (dict(stream="yes"), "stream"),
                          (dict(stop=[1, 2]), "stop"), (dict(n=0), "n"),
                          (dict(extra_body={"num_draft": "five"}), "num_draft"),
                          (dict(extra_body={"drafter": "tree", "draft_budget": 0}), "draft_budget"),
                          (dict(extra_body={"verifier": "nope"}), "verifier"),
                          (dict(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
                          (dict(messages="hello"), "messages")]:
        args = dict(model="tiny", messages=USER, max_tokens=4) | kwargs
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**args)
        assert e.value.status_code == 400, kwargs
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", kwargs
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4)
    assert e.value.body["param"] == "prompt"
    status, _, body = raw(main, "POST", "/v1/completions", json.dumps({"max_tokens": 4}))
    assert status == 400
    assert_error_shape(body, code="missing_required_parameter", param="prompt")
    status, _, body = raw(main, "GET", "/v1/nothing-here")
    assert status == 404
    assert_error_shape(body)


def test_max_tokens_beyond_the_context(main, llm):
    n_prompt = len(llm.encode(USER))
    with pytest.raises(openai.BadRequestError) as e:
        client(main).chat.completions.create(model="tiny", messages=USER, max_tokens=CONTEXT - n_prompt + 1)
    assert e.value.body["code"] == "context_length_exceeded" and str(CONTEXT) in e.value.body["message"]
    ok = client(main).chat.completions.create(model="tiny", messages=USER, max_tokens=1, temperature=0)
    assert ok.usage.completion_tokens == 1
    long_prompt = "word " * (CONTEXT + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client(main).completions.create(model="tiny", prompt=long_prompt)
    assert e.value.body["code"] == "context_length_exceeded"


def test_api_key(keyed):
    status, _, body = raw(keyed, "POST", "/v1/chat/completions", json.dumps({"messages": USER, "max_tokens": 2}))
    assert status == 401
    assert_error_shape(body, code="missing_api_key")
    with pytest.raises(openai.AuthenticationError) as e:
        client(keyed, key="sk-wrong").chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(keyed, key="sk-wrong").models.list()
    ok = client(keyed, key=KEY).chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert raw(keyed, "GET", "/health")[0] == 200  # only health stays open
    assert raw(keyed, "GET", "/metrics")[0] == 401
    assert raw(keyed, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


# --------------------------------------------------------------------------- concurrency

def test_concurrent_clients_get_the_sequential_greedy_texts(main):
    prompts = ["def add(a, b):", "The capital of France is", "import numpy as np\n", "1, 2, 3, 4,", "Dear Sir,"]
    jobs = [[(prompts[(i + j) % len(prompts)], 4 + (i + j) % 3) for j in range(5)] for i in range(8)]

    def run_client(requests):
        c = client(main)
        return [c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).choices[0].text
                for p, n in requests]

    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(run_client, jobs))
    c = client(main)
    sequential = {key: c.completions.create(model="tiny", prompt=key[0], max_tokens=key[1],
                                            temperature=0).choices[0].text
                  for key in {r for requests in jobs for r in requests}}
    for requests, texts in zip(jobs, concurrent):
        assert texts == [sequential[r] for r in requests]


def test_full_queue_answers_429_at_once(keyed):
    """One batch slot and a queue of one: the first request takes the slot, the second
    waits, the third is refused at once."""
    engine = keyed.app.state.scheduler
    c = client(keyed, key=KEY)
    engine.pause()
    try:
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(c.chat.completions.create, model="tiny", messages=USER, max_tokens=3,
                                  temperature=0) for _ in range(2)]
            assert wait_for(lambda: engine.queue_depth == 2)
            t0 = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as e:
                c.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
            assert time.perf_counter() - t0 < 2.0
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
            assert e.value.response.headers.get("retry-after") == "1"
            engine.resume()
            assert [q.result(timeout=30).usage.completion_tokens for q in queued] == [3, 3]
    finally:
        engine.resume()
    assert keyed.app.state.metrics.rejected.value() >= 1


def test_one_failure_does_not_affect_others(main):
    c = client(main)
    before = c.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0, seed=FAIL_SEED)
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    with pytest.raises(openai.APIError):  # mid-stream: an error event instead of [DONE]
        for _ in c.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                           seed=FAIL_SEED, stream=True):
            pass
    after = c.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    assert after.choices[0].message.content == before.choices[0].message.content
    assert main.app.state.metrics.engine_errors.value(kind="internal") >= 2


def _cancelled(server) -> float:
    return server.app.state.metrics.cancelled.value()


def test_disconnect_mid_stream_cancels_the_generation(main):
    metrics, engine = main.app.state.metrics, main.app.state.scheduler
    cancelled, tokens = _cancelled(main), metrics.completion_tokens.value()
    stream = client(main).chat.completions.create(model="tiny", messages=USER, max_tokens=450, temperature=0,
                                                  stream=True, extra_body={"drafter": "none"})
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    stream.close()
    assert wait_for(lambda: _cancelled(main) == cancelled + 1), "the engine never saw the cancel"
    assert wait_for(lambda: engine.running == 0)
    assert metrics.completion_tokens.value() - tokens < 450  # stopped early

    # a non-streaming client that hangs up is noticed too
    body = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 450, "drafter": "none"}).encode()
    with socket.create_connection(("127.0.0.1", main.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: engine.running > 0, 5)
    assert wait_for(lambda: _cancelled(main) == cancelled + 2), "the engine never saw the second cancel"
    # and the server still answers
    assert client(main).chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage.completion_tokens == 2


# --------------------------------------------------------------------------- metrics and the command

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? [-+0-9.eE]+(Inf)?$')


def test_metrics_are_prometheus_text(main):
    client(main).chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    status, headers, body = raw(main, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line
    assert re.search(r'^quasar_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^quasar_verifier_steps_total\{drafter="ngram",verifier="fp"\} [1-9]', text, re.M)
    assert re.search(r'^quasar_acceptance_length_bucket\{drafter="ngram",verifier="fp",le="\+Inf"\} [1-9]',
                     text, re.M)
    assert re.search(r'^quasar_request_duration_seconds_count\{endpoint="/v1/chat/completions"\} [1-9]', text, re.M)
    for name in ("quasar_completion_tokens_total", "quasar_prompt_tokens_total", "quasar_prompt_cached_tokens_total",
                 "quasar_requests_waiting",
                 "quasar_requests_cancelled_total", "quasar_time_to_first_token_seconds_count"):
        assert re.search(rf"^{name} ", text, re.M), name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quasar_serve_command(llm, tmp_path):
    model_dir = Path(llm.loaded.model_dir)
    port = _free_port()
    cmd = [sys.executable, "-m", "quasar", "serve", "--model", str(model_dir), "--port", str(port), "--threads", "1",
           "--max-context", "256", "--drafter", "ngram", "--verifier", "fp", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up():
            try:
                return http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/health") is None
            except OSError:
                return False
        assert wait_for(lambda: up() or proc.poll() is not None, 60) and proc.poll() is None, proc.stdout.read()
        server = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port})
        resp = client(server).chat.completions.create(model=model_dir.name, messages=USER, max_tokens=3,
                                                      temperature=0)
        assert resp.usage.completion_tokens == 3 and resp.model_extra["quasar"]["drafter"] == "ngram"
        assert json.loads(raw(server, "GET", "/health")[2])["max_context"] == 256
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "serving" in out
    # a port that is taken is a one-line error before the model loads
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "quasar", "serve", "--model", str(model_dir), "--port", str(busy)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot listen" in r.stderr
