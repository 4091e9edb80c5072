"""Fuzzed request bodies against the real server: no input may be answered 500.

Hypothesis builds bodies for /v1/chat/completions and /v1/completions from every field
either endpoint reads, each one well formed or junk (wrong types, huge or non-finite
numbers, lone surrogates and other odd Unicode, nested arrays and objects), plus unknown
fields and bodies that are not JSON objects at all; each is POSTed to a server on loopback
(uvicorn in a thread) serving a tiny random model with the real SmolLM2 tokenizer.
Completions are short (max_tokens and the server's default are 1-2 tokens), so most of the
time goes to the request path itself. Every reply must be a 2xx or a 4xx in OpenAI's error
shape, and a streamed reply must not end in a server error. The normal suite runs 2,000
examples (derandomized: the same bodies every run); the slow test runs 20,000 from a random
start."""

from __future__ import annotations

import http.client
import json
import math
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import make_tiny_model  # noqa: E402

from quasar.api import LLM  # noqa: E402
from quasar.server.app import BackgroundServer, create_app  # noqa: E402

VOCAB = 49152
PATHS = ("/v1/chat/completions", "/v1/completions")

# ---------------------------------------------------------------------------- strategies

ODD = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udfff", "\x00", "\u202e\u200b", "\U0001f642" * 3, "", " ",
                       "\r\n", "<|im_start|>", "\\u0000", "word " * 600, "%s%n{}", "\ufeff", "\U0010ffff"])
TEXT = st.one_of(st.text(max_size=24), st.text(st.characters(codec=None), max_size=8),
                 st.text(st.characters(categories=["Cs", "Co", "Cc"]), max_size=4), ODD)
HUGE = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 10**400])
NUMBER = st.one_of(st.integers(-5, 5), HUGE, st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.5, -0.0, 1e308, 5e-324, math.inf, -math.inf, math.nan]))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JUNK = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(TEXT, inner, max_size=4)), max_leaves=10)


ROLES = st.sampled_from(["system", "developer", "user", "assistant"])
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
SHORT = st.integers(1, 2)

# field -> (a value the server takes, an edge: a value of the right type it may refuse)
COMMON = {
    "model": (st.just("tiny"), st.just("gpt-4o")),
    "max_tokens": (SHORT, st.sampled_from([0, -1, 513, 10**9, 1.0, 2.5])),
    "temperature": (st.floats(0, 2), st.floats(2, 1e300)), "top_p": (st.floats(0, 1), st.floats(-1e9, 0)),
    "top_k": (st.integers(0, 60), st.integers(-(2**70), -1)),
    "seed": (st.integers(0, 2**63 - 16), st.one_of(st.integers(-(2**64), -1), st.integers(2**63 - 15, 2**80))),
    "n": (SHORT, st.sampled_from([0, 16, 17, 10**20])),
    "stream": (st.booleans(), st.just(None)),
    "stop": (st.one_of(TEXT, st.lists(TEXT, max_size=3)), st.lists(TEXT, min_size=17, max_size=18)),
    "presence_penalty": (st.just(0), st.sampled_from([0.5, -2.5, 3])), "frequency_penalty": (st.just(0.0), st.just(1)),
    "logit_bias": (st.just({}), st.dictionaries(TEXT, st.integers(-100, 100), min_size=1, max_size=2)),
    "user": (TEXT, st.just("")), "verifier": (st.sampled_from(["fp", "pruned:0.5", "pruned:0.50", "pruned:5e-1"]),
                                              st.sampled_from(["w8a8", "w4a8", "pruned:0", "pruned:nan", "pruned:inf",
                                                               "pruned:-1", "pruned:1e400", "pruned:", "FP"])),
    "drafter": (st.sampled_from(["none", "ngram", "tree", "auto"]), st.sampled_from(["bogus", "NGRAM", ""])),
    "num_draft": (st.integers(1, 8), st.integers(-1, 70)), "ngram_min": (st.just(1), st.integers(0, 8)),
    "ngram_max": (st.integers(1, 3), st.integers(0, 8)), "draft_budget": (st.integers(1, 20), st.integers(-1, 300)),
    "adaptive": (st.booleans(), st.just(0)), "best_of": (st.just(1), st.just(2)),
}
STREAM_OPTIONS = {"stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                                     st.fixed_dictionaries({}, optional={"include_usage": JUNK}))}
CHAT = {**COMMON, "messages": (st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.one_of(
            TEXT, st.lists(PART, max_size=3))}), min_size=1, max_size=3),
            st.lists(st.fixed_dictionaries({"role": st.one_of(ROLES, st.sampled_from(["tool", "bot", ""]))},
                                           optional={"content": JUNK, "name": TEXT}), max_size=3)),
        "max_completion_tokens": (SHORT, st.integers(-3, 0)), "logprobs": (st.booleans(), st.just(1)),
        "top_logprobs": (st.integers(0, 20), st.integers(21, 10**6)), "tools": (st.just([]), st.just([{}])),
        "functions": (st.just([]), JUNK), "tool_choice": (st.just("none"), st.just("auto")),
        "response_format": (st.just({"type": "text"}), st.just({"type": "json_object"}))}
COMPLETION = {**COMMON, "prompt": (st.one_of(TEXT.filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                          max_size=8)),
                                   st.one_of(st.lists(st.integers(-2**40, 2**40), max_size=8),
                                             st.lists(TEXT, max_size=3), st.just(""), st.just([]))),
              "logprobs": (st.integers(0, 5), st.integers(6, 10**9)), "echo": (st.just(False), st.just(True)),
              "suffix": (st.just(""), TEXT)}


def well_formed(fields: dict):
    """Bodies of values the server takes, each field present or not (most are answered 200)."""
    return st.fixed_dictionaries({}, optional={name: valid for name, (valid, _) in fields.items()})


def malformed(fields: dict):
    """Bodies whose fields are valid, at an edge, or junk of any type, plus unknown fields."""
    junky = {name: st.one_of(valid, edge, JUNK) for name, (valid, edge) in fields.items()}
    return st.builds(lambda known, extra: {**extra, **known}, st.fixed_dictionaries({}, optional=junky),
                     st.dictionaries(TEXT, JUNK, max_size=2))


REQUESTS = st.one_of(
    st.tuples(st.just(PATHS[0]), well_formed({**CHAT, **STREAM_OPTIONS}).filter(lambda b: "messages" in b)),
    st.tuples(st.just(PATHS[1]), well_formed(COMPLETION).filter(lambda b: "prompt" in b)),
    st.tuples(st.just(PATHS[0]), malformed({**CHAT, **STREAM_OPTIONS})),
    st.tuples(st.just(PATHS[1]), malformed({**COMPLETION, **STREAM_OPTIONS})),
    st.tuples(st.sampled_from(PATHS), JUNK),  # not an object
    st.tuples(st.sampled_from(PATHS), st.binary(max_size=40)),  # not JSON
)

# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    threads = torch.get_num_threads()
    model_dir = make_tiny_model(tmp_path_factory.mktemp("fuzz") / "tiny", "llama", default_model_dir, 0)
    llm = LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=512, threads=1)
    app = create_app(llm, model_name="tiny", default_max_tokens=2, verifiers=["pruned:0.5"], max_queue=4)
    with BackgroundServer(app) as srv:
        yield srv
    torch.set_num_threads(threads)


class Client:
    """One kept-alive connection, opened again when the server closes it."""

    def __init__(self, port: int):
        self.port, self.conn = port, None

    def post(self, path: str, data: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, ConnectionError, http.client.BadStatusLine):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def check(client: Client, path: str, body) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN / Infinity allowed: junk
    status, reply = client.post(path, data)
    assert status < 500, (status, path, data[:400], reply[:400])
    if status >= 400:
        err = json.loads(reply)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], reply[:400]
    elif reply.startswith(b"data:"):  # streamed: no error event in the stream either
        assert b'"server_error"' not in reply, (path, data[:400], reply[-400:])
    else:
        assert json.loads(reply)["choices"], reply[:400]


SETTINGS = dict(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def test_fuzzed_bodies_are_never_a_500(server):
    client = Client(server.port)

    @settings(max_examples=2000, derandomize=True, **SETTINGS)
    @given(REQUESTS)
    def run(request):
        check(client, *request)

    run()
    for endpoint in PATHS:  # the engine was reached, not only the checks in front of it
        assert server.app.state.metrics.requests.value(endpoint=endpoint, status="200") >= 20, endpoint


@pytest.mark.slow
def test_fuzzed_bodies_are_never_a_500_at_length(server):
    """More bodies, not derandomized: each run tries new ones (QUASAR_FUZZ_EXAMPLES, default
    6,000: about 1.5 min on 2 cores; CI runs it)."""
    client = Client(server.port)

    @settings(max_examples=int(os.environ.get("QUASAR_FUZZ_EXAMPLES", "6000")), **SETTINGS)
    @given(REQUESTS)
    def run(request):
        check(client, *request)

    run()
