"""Every decoding option a user sets is checked in one place (quasar.speculative.options):
an out-of-range value gets the same one-line error from `quasar generate`, from `LLM` and
from the server, which also names the field in `param`.

Not here: `max_tokens` (the server's own field, checked against the context there) and
`logprobs` (no CLI flag); `adaptive` is a CLI switch, never out of range.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import make_tiny_model  # noqa: E402

from quasar.api import LLM  # noqa: E402
from quasar.cli import main  # noqa: E402
from quasar.errors import QuasarError  # noqa: E402
from quasar.server.app import BackgroundServer, create_app  # noqa: E402

BAD = [
    {"num_draft": 65}, {"num_draft": -1}, {"ngram_min": 0}, {"ngram_max": 65}, {"ngram_min": 3, "ngram_max": 2},
    {"draft_budget": 0}, {"draft_budget": 65}, {"drafter": "eagle"}, {"verifier": "int4"},
    {"temperature": -1}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5}, {"stop": [""]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("options") / "char", "llama", None, seed=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), drafter="ngram", verifier="fp", max_context=64, threads=1)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, model_name="tiny")) as srv:
        yield srv


def _flags(options: dict) -> list[str]:
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return flags


def _param(options: dict) -> str:
    return "ngram_max" if "ngram_max" in options else next(iter(options))


@pytest.mark.parametrize("options", BAD, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_an_out_of_range_option_gets_one_message_everywhere(options, model_dir, llm, server, capsys):
    with pytest.raises(QuasarError) as e:
        llm.generate("abc", raw=True, max_new_tokens=2, **options)
    message = str(e.value)
    assert "\n" not in message and e.value.param == _param(options)

    assert main(["generate", "--model", str(model_dir), "--raw", "--prompt", "abc", "--max-new-tokens", "2",
                 *_flags(options)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="abc", max_tokens=2, extra_body=options)
    assert e.value.status_code == 400
    assert e.value.body["message"] == message and e.value.body["param"] == _param(options)


def test_server_defaults_are_the_llms(llm, server):
    """`create_app` takes no drafting defaults of its own: a request that sets none gets the LLM's."""
    with urllib.request.urlopen(server.url + "/health") as resp:
        health = json.loads(resp.read())
    d = llm.draft
    assert health["defaults"] == {"drafter": d.drafter, "verifier": llm.verifier, "num_draft": d.num_draft,
                                  "ngram_min": d.ngram_min, "ngram_max": d.ngram_max, "adaptive": d.adaptive,
                                  "draft_budget": d.draft_budget}
