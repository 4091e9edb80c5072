"""`quasar serve` against hostile or careless clients (issue #48): input that used to be a
500, requests that could make the server build and keep models, what the API key covers,
the keyless server's Host and Content-Type rules, and admission filling the batch before
429. Real servers on loopback (uvicorn in a thread, or the `quasar serve` command), a tiny
random model with the real SmolLM2 tokenizer."""

from __future__ import annotations

import base64
import gc
import json
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from conftest import make_tiny_model  # noqa: E402
from test_server import assert_error_shape, raw, wait_for  # noqa: E402

from quasar.server.app import BackgroundServer, create_app  # noqa: E402
from quasar.server.openai_schema import MAX_SEED  # noqa: E402

KEY = "sk-quasar-security"
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def open_server(llm):
    """No key; offers pruned:0.5 and pruned:1 besides fp, two built at a time; one extra host name."""
    app = create_app(llm, model_name="tiny", verifiers=["pruned:0.50", "pruned:1"], max_verifiers=2,
                     allowed_hosts=["quasar.lan"])
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(llm):
    with BackgroundServer(create_app(llm, api_key=KEY, model_name="tiny")) as srv:
        yield srv


def post(server, path: str, body: dict | str, headers: dict | None = None):
    data = body if isinstance(body, str) else json.dumps(body)
    return raw(server, "POST", path, data, {"Content-Type": "application/json", **(headers or {})})


# --------------------------------------------------------------------------- 400, never 500

@pytest.mark.parametrize("seed", [99999999999999999999999, -1, 2**63, MAX_SEED + 1, 1e30, -(2**70)])
def test_a_seed_out_of_range_is_400_naming_it(open_server, seed):
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "seed": seed}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "seed": seed})]:
        status, _, reply = post(open_server, path, body)
        assert status == 400, (seed, reply)
        assert_error_shape(reply, param="seed")


def test_the_largest_seed_still_samples_every_choice(open_server):
    status, _, reply = post(open_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "seed": MAX_SEED,
                                                             "n": 16, "temperature": 1.0})
    assert status == 200 and len(json.loads(reply)["choices"]) == 16


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "abc\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udfff"], "max_tokens": 1}', "prompt[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00x"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop[0]"),
    ("/v1/completions", '{"prompt": "Hi", "\\ud800": 1, "max_tokens": 1}', "\\ud800"),
])
def test_a_lone_surrogate_is_400_naming_where(open_server, path, body, param):
    status, _, reply = post(open_server, path, body)
    assert status == 400, reply
    assert_error_shape(reply, code="invalid_value", param=param)


def test_a_surrogate_pair_is_text(open_server):
    status, _, reply = post(open_server, "/v1/completions", '{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 1}')
    assert status == 200, reply


# --------------------------------------------------------------------------- verifiers offered

def _completion(server, verifier, max_tokens: int = 4):
    return post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": max_tokens,
                                            "temperature": 0, "verifier": verifier})


def test_requests_choose_only_among_the_offered_verifiers(open_server):
    for spelling in ("pruned:0.5", "pruned:0.500", "pruned:5e-1", "pruned:0.5_0"):
        status, _, reply = _completion(open_server, spelling)
        assert status == 200, (spelling, reply)
        assert json.loads(reply)["quasar"]["verifier"] == "pruned:0.5"
    health = json.loads(raw(open_server, "GET", "/health")[2])
    assert health["verifiers"] == ["fp", "pruned:0.5", "pruned:1"]
    for name in ("w8a8", "w4a8", "pruned:0.25", "pruned:0.999999"):
        status, _, reply = _completion(open_server, name)
        assert status == 400, name
        err = assert_error_shape(reply, code="verifier_not_offered", param="verifier")
        assert "fp, pruned:0.5, pruned:1" in err["message"] and len(err["message"]) < 300
    for name in ("nope", "pruned:2", "pruned:nan", "x" * 10_000):  # no verifier at all: LLM's own message
        status, _, reply = _completion(open_server, name)
        assert status == 400, name
        err = assert_error_shape(reply, code="invalid_value", param="verifier")
        assert "verifier" in err["message"] and len(err["message"]) <= 300


def test_verifiers_beyond_the_cap_are_released_least_recently_used_first(open_server, llm):
    greedy = {name: json.loads(_completion(open_server, name)[2])["choices"][0]["text"]
              for name in ("fp", "pruned:0.5", "pruned:1")}
    assert len(llm.resident_verifiers) <= 2
    assert _completion(open_server, "pruned:1")[0] == 200
    model = llm.verifier_model("pruned:1")  # resident: this builds nothing
    model_ref, cache_ref = weakref.ref(model), weakref.ref(model.cache)
    del model
    assert _completion(open_server, "fp")[0] == 200
    assert _completion(open_server, "pruned:0.5")[0] == 200  # pruned:1 is now the least recently used
    assert set(llm.resident_verifiers) == {"fp", "pruned:0.5"}
    gc.collect()
    assert model_ref() is None and cache_ref() is None, "the released verifier or its KV cache is still held"
    for name in ("fp", "pruned:1", "pruned:0.5", "fp"):  # rebuilt on demand, same greedy text
        status, _, reply = _completion(open_server, name)
        assert status == 200 and json.loads(reply)["choices"][0]["text"] == greedy[name]
        assert len(llm.resident_verifiers) <= 2


def test_metrics_labels_come_only_from_the_offered_verifiers(open_server):
    for name in ("pruned:0.50000", "w8a8", "evil\"label", "pruned:0.3"):
        _completion(open_server, name, max_tokens=1)
    text = raw(open_server, "GET", "/metrics")[2].decode()
    assert set(re.findall(r'verifier="([^"]*)"', text)) <= {"fp", "pruned:0.5", "pruned:1"}


# --------------------------------------------------------------------------- the key

def _routes(server) -> list[tuple[str, str]]:
    """Every (method, path) the app routes, a path parameter filled in, and one it does not."""
    out = [("GET", "/no-such-route"), ("GET", "/redoc")]
    for route in server.app.routes:
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        out += [(m, path) for m in sorted(getattr(route, "methods", None) or {"GET"}) if m != "HEAD"]
    return out


def test_the_key_covers_every_route_but_health(keyed_server):
    routes = _routes(keyed_server)
    paths = {p for _, p in routes}
    assert {"/", "/docs", "/openapi.json", "/metrics", "/v1/models", "/v1/chat/completions"} <= paths
    for method, path in routes:
        body = json.dumps({"prompt": "Hi", "max_tokens": 1}) if method == "POST" else None
        status, headers, reply = raw(keyed_server, method, path, body)
        if path == "/health":
            assert status == 200
            continue
        assert status == 401, (method, path, status)
        assert_error_shape(reply, code="missing_api_key")
        wrong = raw(keyed_server, method, path, body, {"Authorization": "Bearer sk-wrong",
                                                      "Content-Type": "application/json"})
        assert wrong[0] == 401, (method, path)
        good = raw(keyed_server, method, path, body, {"Authorization": f"Bearer {KEY}",
                                                     "Content-Type": "application/json"})
        assert good[0] != 401, (method, path)


def test_a_browser_opens_the_keyed_playground_with_http_basic(keyed_server):
    status, headers, _ = raw(keyed_server, "GET", "/")
    assert status == 401 and headers["www-authenticate"].startswith("Basic realm=")
    assert "www-authenticate" not in raw(keyed_server, "GET", "/v1/models")[1]  # API clients get no prompt

    def basic(password: str) -> dict:
        return {"Authorization": "Basic " + base64.b64encode(f"anyone:{password}".encode()).decode()}

    status, _, page = raw(keyed_server, "GET", "/", headers=basic(KEY))
    assert status == 200 and b"tok-draft" in page
    assert raw(keyed_server, "GET", "/", headers=basic("sk-wrong"))[0] == 401
    assert raw(keyed_server, "GET", "/", headers={"Authorization": "Basic !!notbase64"})[0] == 401
    # what the page's own requests carry then: the browser re-sends the same credentials
    status, _, _ = raw(keyed_server, "POST", "/v1/chat/completions", json.dumps({"messages": CHAT, "max_tokens": 1}),
                       {"Content-Type": "application/json", **basic(KEY)})
    assert status == 200


# --------------------------------------------------------------------------- keyless: Host and Content-Type

def test_a_keyless_server_answers_only_to_its_own_host_names(open_server):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    port = open_server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.2",
                 "LOCALHOST", "quasar.lan", f"quasar.lan:{port}"):
        assert raw(open_server, "GET", "/health", headers={"Host": host})[0] == 200, host
        assert raw(open_server, "POST", "/v1/completions", body,
                   {"Host": host, "Content-Type": "application/json"})[0] == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                 "quasar.lan.evil.example", "10.0.0.1", ""):
        for method, path, data in (("GET", "/", None), ("GET", "/v1/models", None), ("POST", "/v1/completions", body)):
            status, _, reply = raw(open_server, method, path, data, {"Host": host, "Content-Type": "application/json"})
            assert status == 400, (host, path, status)
            assert_error_shape(reply, code="invalid_host")


def test_a_post_body_must_be_json(open_server, keyed_server):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    for server, auth in ((open_server, {}), (keyed_server, {"Authorization": f"Bearer {KEY}"})):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "text/plain; charset=application/json", None):
            headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
            status, _, reply = raw(server, "POST", "/v1/completions", body, headers)
            assert status == 415, (ctype, status)
            assert_error_shape(reply, code="unsupported_media_type")
        ok = raw(server, "POST", "/v1/completions", body, {**auth, "Content-Type": "Application/JSON; charset=utf-8"})
        assert ok[0] == 200


# --------------------------------------------------------------------------- admission

def test_admission_fills_every_batch_slot_before_429(llm):
    """--max-queue 4 --max-batch 8: of 40 requests sent at once while the engine is paused,
    8 take the batch's slots, 4 wait, 28 are refused; then 8 decode together."""
    app = create_app(llm, model_name="tiny", max_queue=4, max_batch=8)
    engine, peak, done = app.state.scheduler, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], engine.running)
            time.sleep(0.002)

    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "drafter": "none"})
    with BackgroundServer(app) as srv:
        engine.pause()
        with ThreadPoolExecutor(40) as pool:
            futures = [pool.submit(raw, srv, "POST", "/v1/completions", body) for _ in range(40)]
            assert wait_for(lambda: sum(f.done() for f in futures) == 28, 30)
            assert engine.queue_depth == 12
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            engine.resume()
            statuses = sorted(f.result(timeout=60)[0] for f in futures)
        done.set()
        watcher.join()
    assert statuses == [200] * 12 + [429] * 28
    assert peak[0] == 8


# --------------------------------------------------------------------------- memory, end to end

def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hundred_verifier_spellings_keep_one_verifier_resident(tmp_path, default_model_dir):
    """`quasar serve --verifiers pruned:0.5`: 100 requests naming verifiers in distinct
    spellings (60 of the offered one, 40 not offered) leave the server's resident memory
    within 10% of what it was after one, and /metrics names only offered verifiers. Each
    prompt fills 1,500 positions of the KV cache (6 MB here), so a cache per spelling would
    show."""
    model = make_tiny_model(tmp_path / "wide", "llama", default_model_dir, 0, hidden_size=256, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quasar", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--max-context", "4096", "--drafter", "ngram", "--verifier", "fp",
                             "--verifiers", "pruned:0.5", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = type("S", (), {"port": port})
    try:
        assert wait_for(lambda: _up(server) or proc.poll() is not None, 90) and proc.poll() is None

        def ask(verifier: str) -> int:
            body = {"prompt": list(range(100, 1600)), "max_tokens": 1, "verifier": verifier}
            return post(server, "/v1/completions", body)[0]

        assert ask("pruned:0.5") == 200 and ask("fp") == 200
        before = _rss_bytes(proc.pid)
        same = [f"pruned:0.5{'0' * i}" for i in range(50)] + [f"pruned:{5 * 10**i}e-{i + 1}" for i in range(10)]
        other = [f"pruned:0.{i + 10}" for i in range(30)] + [f"w{i}a8" for i in range(10)]
        assert [ask(v) for v in same] == [200] * 60
        assert [ask(v) for v in other] == [400] * 40
        after = _rss_bytes(proc.pid)
        assert after <= 1.10 * before, (before, after)
        text = raw(server, "GET", "/metrics")[2].decode()
        assert set(re.findall(r'verifier="([^"]*)"', text)) == {"fp", "pruned:0.5"}
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _up(server) -> bool:
    try:
        return raw(server, "GET", "/health")[0] == 200
    except OSError:
        return False
