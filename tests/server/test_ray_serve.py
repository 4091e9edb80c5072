"""`quasar serve --replicas`: the server as replicas on Ray Serve, on a local Ray of 2 CPUs.

One Ray instance and one application (2 replicas of the default model, 1 thread each) are
shared by the tests of this module. The application is deployed while two plain processes
load the same model, all four into a fresh cache: the W8A8 entry is built once. Replies go
through Ray's own HTTP proxy, with the real `openai` client, and are compared with the
one-process server's. The test that kills a replica runs last: Ray replaces it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from quasar.server.affinity import SESSION_HEADER, conversation_key

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
SETTINGS = {"model": "default", "replicas": 2, "threads": 1, "drafter": "ngram", "max_context": 512,
            "max_batch": 4, "max_queue": 16}
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "What is the capital of France?"]
REPLICA = "x-quasar-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- without a cluster


def test_without_replicas_ray_is_never_imported():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    code = ("import sys; import quasar.server.app; from quasar.cli import main; "
            f"rc = main(['serve', '--port', '{port}']); "
            "assert rc == 2, rc; assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]; "
            "print('no ray')")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert out.returncode == 0, out.stderr
    assert "no ray" in out.stdout and "cannot listen on" in out.stderr


def test_a_missing_ray_is_one_line_naming_the_extra():
    code = ("import sys; sys.modules['ray'] = None; from quasar.cli import main; "
            "sys.exit(main(['serve', '--replicas', '2']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'quasar-llm[ray]'" in lines[0], out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--replicas", "2", "--max-replicas", "1"], "--max-replicas must be at least --replicas"),
    (["--ray-address", "auto"], "--ray-address needs --replicas"),
])
def test_bad_replica_options_are_one_line(argv, message, capsys):
    from quasar.cli import main

    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_conversation_keeps_its_key_across_turns():
    first = {"messages": [{"role": "system", "content": "Be brief."}, *_chat("Name a colour.")]}
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "Blue."},
                           *_chat("And another?")]}
    other = {"messages": [{"role": "system", "content": "Be brief."}, *_chat("Name a fruit.")]}
    assert conversation_key(first) == conversation_key(second) != conversation_key(other)
    assert conversation_key({**first, "user": "ann"}) == conversation_key({**other, "user": "ann"})
    assert conversation_key({"prompt": "Once upon a time"}) == conversation_key({"prompt": "Once upon a time"})
    assert conversation_key({"model": "x"}) is None and conversation_key([1]) is None


def _serve_configs() -> list[dict]:
    serve_config = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())
    service = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    return [serve_config, yaml.safe_load(service["spec"]["serveConfigV2"])]


def test_deploy_files_pass_rays_own_schema():
    pytest.importorskip("ray")
    from ray.serve.schema import ServeDeploySchema

    from quasar.cli.ray_app import DEPLOYMENT_NAME, build_app

    for config in _serve_configs():
        schema = ServeDeploySchema.model_validate(config)
        (app,) = schema.applications
        assert app.import_path == "quasar.cli.ray_app:build_app"
        assert build_app(app.args) is not None  # the args are `quasar serve` options
        assert [d.name for d in app.deployments] in ([], [DEPLOYMENT_NAME])


# --------------------------------------------------------------------------- one local Ray instance


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache with no W8A8 entry (the converted model and the compiled kernels linked in)."""
    from quasar.paths import cache_root

    cache = tmp_path_factory.mktemp("ray-cache")
    for sub in ("gguf", "torch_ext"):
        (cache_root() / sub).mkdir(parents=True, exist_ok=True)
        (cache / sub).symlink_to((cache_root() / sub).resolve(), target_is_directory=True)
    return cache


@pytest.fixture(scope="module")
def ray_instance(fresh_cache):
    ray = pytest.importorskip("ray")
    from ray import serve

    from quasar.server.affinity import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    saved = {k: os.environ.get(k) for k in ("QUASAR_CACHE", PROXY_CALLBACK_ENV)}
    os.environ.update({"QUASAR_CACHE": str(fresh_cache), PROXY_CALLBACK_ENV: PROXY_CALLBACK})  # Ray's processes inherit them
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level="warning", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _watch_builds(cache: Path, stop: threading.Event, seen: set) -> None:
    """Record every build's temporary folder (`.NAME.tmp-PID-RANDOM`) that appears among the cache's entries."""
    from quasar.paths import ENTRY_KINDS

    while not stop.wait(0.05):
        for kind in ENTRY_KINDS:
            try:
                seen.update(f"{kind}/{n}" for n in os.listdir(cache / kind) if ".tmp-" in n)
            except FileNotFoundError:
                pass


@pytest.fixture(scope="module")
def cluster(ray_instance, fresh_cache):
    """The application deployed (2 replicas) while two plain processes load the same model."""
    from ray import serve

    from quasar.cli.ray_app import APP_NAME, build_app

    seen: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_builds, args=(fresh_cache, stop, seen), daemon=True)
    watcher.start()
    cmd = [sys.executable, "-m", "quasar", "generate", "--model", "default", "--threads", "1", "--drafter", "ngram",
           "--max-new-tokens", "4", "--prompt", "Hi"]
    plain = [subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        serve.run(build_app(SETTINGS), name=APP_NAME, route_prefix="/")
        outs = [p.communicate(timeout=600) for p in plain]
    finally:
        for p in plain:
            p.kill()
        stop.set()
        watcher.join()
    yield {"url": ray_instance, "builds": seen, "plain": [(p.returncode, out, err) for p, (out, err) in zip(plain, outs)],
           "cache": fresh_cache}


@pytest.fixture(scope="module")
def client(cluster):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def one_process(cluster):
    """The one-process server of the same options (in this process, on the same cache)."""
    openai = pytest.importorskip("openai")
    import torch

    from quasar.server.app import BackgroundServer
    from quasar.cli.serve_launch import engine_app
    from quasar.cli.ray_app import parse_settings

    threads = torch.get_num_threads()
    app = engine_app(parse_settings(SETTINGS))
    try:
        with BackgroundServer(app) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_replicas_and_processes_build_the_cache_entry_once(cluster):
    """The default verifier's entry (W4A8 for the default model's 4-bit GGUF; W8A8 entries are
    written the same way, fileio.atomic_dir under cache.locking.entry_lock)."""
    from quasar.cache.manifest import verify

    for rc, out, err in cluster["plain"]:
        assert rc == 0, err
        assert out.strip()
    builds = cluster["builds"]
    assert len(builds) == 1, builds  # one temporary folder: one build; the other three waited and loaded it
    kind = next(iter(builds)).split("/")[0]
    entries = os.listdir(cluster["cache"] / kind)
    whole = [e for e in entries if not e.startswith(".")]
    assert len(whole) == 1 and not [e for e in entries if ".tmp-" in e], entries
    verify(cluster["cache"] / kind / whole[0], required=True)


def _reply(client, text: str, stream: bool) -> tuple[str, str]:
    """(reply text, replica) of a greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(model="SmolLM2-135M-Instruct", messages=_chat(text),
                                                           max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    replica = raw.headers.get(REPLICA, "")
    reply = raw.parse()
    if not stream:
        return reply.choices[0].message.content, replica
    return "".join(c.choices[0].delta.content or "" for c in reply if c.choices), replica


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_replies_match_the_one_process_server(client, one_process, stream):
    for text in PROMPTS:
        expected, _ = _reply(one_process, text, stream)
        got, replica = _reply(client, text, stream)
        assert got == expected, text
        assert replica


@pytest.mark.slow
def test_16_concurrent_requests_use_both_replicas(client):
    def one(i):
        return _reply(client, f"Count from {i} to {i + 3}.", False)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(text for text, _ in results)
    assert len({replica for _, replica in results}) == 2


@pytest.mark.slow
def test_a_conversations_second_turn_goes_to_the_replica_of_its_first(client):
    for topic in ("the moon", "rivers", "bread", "chess"):
        first = _chat(f"Tell me one fact about {topic}.")
        raw = client.chat.completions.with_raw_response.create(messages=first, model="SmolLM2-135M-Instruct",
                                                               max_tokens=8, temperature=0)
        answer = raw.parse().choices[0].message.content
        second = [*first, {"role": "assistant", "content": answer}, *_chat("Tell me another.")]
        again = client.chat.completions.with_raw_response.create(messages=second, model="SmolLM2-135M-Instruct",
                                                                 max_tokens=8, temperature=0)
        assert again.headers[REPLICA] == raw.headers[REPLICA], topic
    # an explicit session header wins over the body's key
    sessions = {client.chat.completions.with_raw_response.create(
        messages=_chat(f"Say {word}."), model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
        extra_headers={SESSION_HEADER: "one-session"}).headers[REPLICA] for word in ("yes", "no", "maybe")}
    assert len(sessions) == 1


@pytest.mark.slow
def test_a_conversation_over_its_replicas_limit_spills_to_the_other(client):
    """One session, more requests at once than a replica's batch (the router's affinity limit):
    the home replica takes no more than a batch or one beyond the other's load, the rest go to
    the least loaded replica, so both serve it."""
    def one(i):
        raw = client.chat.completions.with_raw_response.create(
            messages=_chat(f"Write a poem about the number {i}."), model="SmolLM2-135M-Instruct", max_tokens=24,
            temperature=0, extra_headers={SESSION_HEADER: "a-busy-session"})
        return raw.headers[REPLICA]

    with ThreadPoolExecutor(2 * SETTINGS["max_batch"]) as pool:
        replicas = list(pool.map(one, range(2 * SETTINGS["max_batch"])))
    counts = sorted(replicas.count(r) for r in set(replicas))
    assert len(counts) == 2 and counts[-1] >= SETTINGS["max_batch"], replicas


@pytest.mark.slow
def test_models_and_metrics_name_the_replica(cluster, client, one_process):
    import urllib.request

    assert [m.id for m in client.models.list()] == [m.id for m in one_process.models.list()]
    with urllib.request.urlopen(cluster["url"] + "/metrics", timeout=30) as r:
        text, replica = r.read().decode(), r.headers[REPLICA]
    assert f'quasar_requests_total{{replica="{replica}",' in text


def _replica_actor(name: str):
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith("#" + name):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no replica actor named {name}")


def _streamed(client, i: int, seen: list, session: str | None = None) -> tuple[str, str, str | None]:
    """(replica, outcome, finish_reason) of a long streamed request: outcome "ok" or the error.
    Its replica is added to `seen` once its first chunk arrived."""
    replica = ""
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct", messages=_chat(f"Write a long story about a cat named {i}."),
            max_tokens=64, temperature=0, stream=True, extra_headers={SESSION_HEADER: session} if session else None)
        replica = raw.headers.get(REPLICA, "")
        finish = None
        for chunk in raw.parse():
            seen.append(replica)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return replica, "ok", finish
    except Exception as e:  # what a client of the killed replica sees
        return replica, f"{type(e).__name__}: {e}", None


@pytest.mark.slow
def test_a_killed_replica_is_restarted_and_nothing_hangs(client):
    import ray
    from ray import serve

    from quasar.cli.ray_app import APP_NAME, DEPLOYMENT_NAME

    seen: list[str] = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_streamed, client, i, seen) for i in range(6)]
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = seen[0]  # a replica streaming a reply now
        ray.kill(_replica_actor(victim), no_restart=True)
        results = [f.result(timeout=180) for f in futures]  # nothing hangs
    survivors = [(outcome, finish) for r, outcome, finish in results if r and r != victim]
    assert survivors and all(outcome == "ok" and finish for outcome, finish in survivors), results
    # the killed replica's requests in flight end in an error or a stream cut before its end
    # (one that had not started its reply yet has no replica header: an error, or retried elsewhere)
    assert any(outcome != "ok" or finish is None for r, outcome, finish in results if r == victim), results
    assert all(outcome == "ok" or "Error" in outcome for _, outcome, _ in results)
    replacement = _wait_for_replacement(serve, APP_NAME, DEPLOYMENT_NAME, victim)
    answered = {_reply(client, f"Say {i}.", False)[1] for i in range(16)}
    assert victim not in answered and replacement in answered, (answered, replacement)


def _replica_names() -> set[str]:
    import ray

    return {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::")}


def _wait_for_replacement(serve, app: str, deployment: str, victim: str, timeout: float = 300) -> str:
    """The replica Ray started in place of `victim`, once it and the other one run."""
    deadline = time.monotonic() + timeout
    before = _replica_names() - {victim}
    while time.monotonic() < deadline:
        names = _replica_names() - {victim}
        status = serve.status().applications[app].deployments[deployment]
        if len(names - before) == 1 and status.replica_states.get("RUNNING", 0) == 2 and status.status == "HEALTHY":
            return next(iter(names - before))
        time.sleep(1)
    pytest.fail(f"Ray did not replace the killed replica: {serve.status()}")


@pytest.mark.slow
def test_scaling_down_lets_the_streams_in_flight_finish(client):
    from ray import serve

    from quasar.cli.ray_app import APP_NAME, DEPLOYMENT_NAME, parse_settings, quasar_app

    seen: list[str] = []
    n = SETTINGS["max_batch"] + 2  # one session over a replica's limit: streams on both replicas
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_streamed, client, 100 + i, seen, "a-draining-session") for i in range(n)]
        deadline = time.monotonic() + 120
        while len(set(seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        update = threading.Thread(target=serve.run, args=(quasar_app(parse_settings(SETTINGS), num_replicas=1),),
                                  kwargs={"name": APP_NAME, "route_prefix": "/"})
        update.start()
        draining = False  # a replica stopping while streams are in flight
        while update.is_alive() and not draining:
            states = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
            draining = states.get("STOPPING", 0) > 0 and not all(f.done() for f in futures)
            time.sleep(0.05)
        update.join(180)
        results = [f.result(timeout=180) for f in futures]
    assert draining and len({r for r, _, _ in results}) == 2, results
    assert all(outcome == "ok" and finish for _, outcome, finish in results), results
    deadline = time.monotonic() + 120
    while serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states != {"RUNNING": 1}:
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)



@pytest.mark.slow
def test_an_api_key_guards_the_replicas_as_it_does_one_process(cluster):
    """The same access rules through Ray's proxy: with a key every route but /health needs it
    (last in the module: it redeploys the application with a key)."""
    import urllib.error
    import urllib.request

    from ray import serve

    from quasar.cli.ray_app import APP_NAME, build_app

    serve.run(build_app({**SETTINGS, "replicas": 1, "api_key": "s3cret"}), name=APP_NAME, route_prefix="/")

    def status(path: str, key: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(cluster["url"] + path, headers=headers), timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status("/health") == 200
    assert status("/v1/models") == 401 and status("/v1/models", "wrong") == 401
    assert status("/v1/models", "s3cret") == 200
