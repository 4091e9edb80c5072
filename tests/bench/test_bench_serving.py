"""`quasar bench --protocol serving` against real servers: `quasar serve` and llama-server
started as subprocesses, real streamed requests through the `openai` client, the outputs
read back from disk, and every server checked gone afterwards (process group, port)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")

from quasar.bench.engine import Unavailable  # noqa: E402
from quasar.bench.serving import (NGRAM_GRID, ServingConfig, ServingPrompt, run_serving, time_server,  # noqa: E402
                                  turns)
from quasar.bench.serving_client import RequestResult, pool_phases, summarize  # noqa: E402
from quasar.errors import QuasarError  # noqa: E402
from quasar.bench.serving_report import SERVING_JSON, SERVING_MD, write_serving  # noqa: E402
from quasar.bench.serving_servers import (check_llama_server, default_llama_server, port_open,  # noqa: E402
                                          quasar_spec)

MAX_TOKENS = 5
# The default verifier would be quantized again in each test session's private cache; the
# protocol is what is under test here, so `quasar serve` decodes with the float verifier.
FP = ("--verifier", "fp")


def _gone(pid: int, port: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return not port_open(port)
    return False


def _check_phases(rec: dict, concurrency: tuple[int, ...], n_prompts: int) -> None:
    assert rec["status"] == "ok", rec["status"]
    assert sorted(rec["phases"]) == sorted(str(c) for c in concurrency)
    for c in concurrency:
        ph = rec["phases"][str(c)]
        assert ph["concurrency"] == c and ph["requests"] == n_prompts == len(ph["per_request"])
        assert ph["counted_by"] == ["usage"]
        for r in ph["per_request"]:
            # the server's own count: exactly max_tokens when it stopped for length
            if r["finish_reason"] == "length":
                assert r["completion_tokens"] == MAX_TOKENS
            else:
                assert r["finish_reason"] == "stop" and 1 <= r["completion_tokens"] <= MAX_TOKENS
            assert r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"]
        assert ph["completion_tokens"] == sum(r["completion_tokens"] for r in ph["per_request"])
        if ph["cached_tokens"] is not None:  # the server reports prompt-cache reuse
            assert 0 <= ph["cached_tokens"] == sum(r["cached_tokens"] or 0 for r in ph["per_request"])
            assert ph["cached_tokens"] <= ph["prompt_tokens"]
        assert ph["aggregate_tokens_per_s"] == pytest.approx(ph["completion_tokens"] / ph["wall_s"], rel=1e-2)
        assert ph["median_ttft_s"] > 0 and ph["median_decode_tokens_per_s"] > 0
    assert [p["concurrency"] for p in rec["processes"]] == list(concurrency)  # a fresh server per phase
    assert all(_gone(p["pid"], p["port"]) for p in rec["processes"])


def _config(tmp_path: Path, **kw) -> ServingConfig:
    base = dict(tasks=["code", "qa"], n=1, max_tokens=MAX_TOKENS, concurrency=(1, 2), threads=2,
                out=str(tmp_path), ready_timeout_s=300.0)
    return ServingConfig(**{**base, **kw})


@pytest.mark.slow  # two server starts and four requests: about half a minute on two cores
def test_quasar_serve_through_the_protocol(tmp_path):
    results = run_serving(_config(tmp_path, servers=("quasar",), quasar_args=FP))
    paths = write_serving(results, tmp_path)
    on_disk = json.loads(paths["json"].read_text())
    rec = on_disk["servers"]["quasar"]
    _check_phases(rec, (1, 2), 2)
    assert rec["kind"] == "quasar" and rec["flags"] == list(FP) and "quasar serve" in rec["command"]
    assert {r["task"] for r in rec["phases"]["1"]["per_request"]} == {"code", "qa"}
    assert rec["phases"]["1"]["cached_tokens"] is not None  # ours reports its prompt cache
    md = paths["markdown"].read_text()
    assert on_disk["environment"]["cpu"] in md and "| quasar serve |" in md and "c=2" in md
    assert on_disk["sweep"] is None and on_disk["config"]["concurrency"] == [1, 2]
    assert (tmp_path / "serving-logs" / "quasar-serve-c1.log").is_file()


def test_a_failing_request_is_the_row_result_and_the_server_stops(tmp_path):
    cfg = _config(tmp_path, quasar_args=(*FP, "--max-context", "64"))
    spec = quasar_spec(cfg.model, 2, cfg.quasar_args)
    long_prompt = ServingPrompt("long", "qa", messages=({"role": "user", "content": "word " * 200},))
    rec = time_server(spec, [long_prompt], cfg, tmp_path, (1,))
    assert rec["status"].startswith("failed at concurrency 1: BadRequestError"), rec["status"]
    assert len(rec["processes"]) == 1 and _gone(rec["processes"][0]["pid"], rec["processes"][0]["port"])


def test_missing_llama_server_is_reported_unavailable(tmp_path):
    missing = tmp_path / "no-such-llama-server"
    results = run_serving(_config(tmp_path, servers=("llama-server", "llama-server-ngram"), llama_server=str(missing)))
    for name in ("llama-server", "llama-server-ngram"):
        status = results["servers"][name]["status"]
        assert status.startswith("unavailable: no llama-server at") and "install_llamacpp.sh" in status
    assert results["sweep"] is None
    write_serving(results, tmp_path)
    assert "unavailable: no llama-server" in (tmp_path / SERVING_MD).read_text()
    # present but not executable
    missing.write_text("")
    with pytest.raises(Unavailable, match="not executable"):
        check_llama_server(missing)


def test_a_server_that_dies_while_starting_is_unavailable_with_its_log(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'cannot load the model file'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    results = run_serving(_config(tmp_path, servers=("llama-server",), llama_server=str(fake), concurrency=(1,)))
    status = results["servers"]["llama-server"]["status"]
    assert "exited with status 3" in status and "cannot load the model file" in status


def test_servers_take_turns_and_rounds_pool_their_requests():
    """Each concurrency's phases run server after server, the order reversed every other
    round; a server's rounds of a phase pool into one (tokens over summed wall time, medians
    over all requests)."""
    assert turns(["q", "l"], (1, 4), 2) == [(0, 1, "q"), (0, 1, "l"), (0, 4, "q"), (0, 4, "l"),
                                            (1, 1, "l"), (1, 1, "q"), (1, 4, "l"), (1, 4, "q")]

    def request(rate: float, ttft: float, cached: int | None) -> RequestResult:
        return RequestResult("p", "qa", 11, "usage", "length", 50, cached, ttft, 10 / rate, ttft + 10 / rate, rate, 0.0)

    one = summarize([request(10.0, 0.5, 0), request(20.0, 1.0, 30)], 3.0, 4)
    two = summarize([request(30.0, 2.0, 40)], 1.0, 4)
    pooled = pool_phases([one, two])
    assert pooled["requests"] == 3 and pooled["completion_tokens"] == 33 and pooled["wall_s"] == 4.0
    assert pooled["aggregate_tokens_per_s"] == pytest.approx(33 / 4.0)
    assert pooled["median_decode_tokens_per_s"] == 20.0 and pooled["median_ttft_s"] == 1.0
    assert pooled["cached_tokens"] == 70 and pooled["prompt_tokens"] == 150 and pooled["rounds"] == 2
    assert pooled["pooled_decode_tokens_per_s"] == pytest.approx(30 / (1.0 + 0.5 + 10 / 30), abs=2e-3)
    assert pool_phases([one]) is one
    assert summarize([request(10.0, 0.5, None)], 1.0, 1)["cached_tokens"] is None  # a server that says nothing
    with pytest.raises(QuasarError, match="--rounds"):
        ServingConfig(rounds=0).validate()


def test_cli_writes_serving_outputs(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "quasar", "bench", "--protocol", "serving", "--servers", "llama-server",
                        "--llama-server", str(tmp_path / "absent"), "--tasks", "qa", "--n", "1",
                        "--bandwidth-gb", "0.01", "--concurrency", "1,4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| llama-server |" in r.stdout and "unavailable" in r.stdout
    data = json.loads((out / SERVING_JSON).read_text())
    assert data["config"]["concurrency"] == [1, 4] and data["environment"]["bandwidth"]["gb_per_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "quasar", "bench", "--protocol", "serving", "--concurrency", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--concurrency" in bad.stderr


needs_llama_server = pytest.mark.skipif(not default_llama_server().is_file(),
                                        reason=f"no {default_llama_server()} (bash scripts/setup/install_llamacpp.sh)")


@needs_llama_server
def test_llama_server_knows_the_sweeps_flags():
    text = subprocess.run([str(default_llama_server()), "--help"], capture_output=True, text=True, timeout=60).stdout
    for mode in ("ngram-simple", "ngram-map-k", "ngram-mod"):
        assert mode in text
    flags = {a for _, grid_flags in NGRAM_GRID for a in grid_flags if a.startswith("--")} | {"--spec-default"}
    assert all(f in text for f in flags), sorted(f for f in flags if f not in text)


@pytest.mark.slow
@needs_llama_server
def test_llama_server_plain_through_the_protocol(tmp_path):
    results = run_serving(_config(tmp_path, servers=("llama-server",)))
    rec = results["servers"]["llama-server"]
    _check_phases(rec, (1, 2), 2)
    assert rec["flags"] == [] and "--parallel 2" in rec["command"] and "-t 2" in rec["command"]
    assert results["environment"]["llama_server_version"]
