"""`quasar serve`: an OpenAI-compatible HTTP server with a playground at `/`.

Only argparse at import time: the command runs in quasar.cli.serve_run, imported when it
runs, which imports FastAPI, uvicorn and the model. With `--replicas N` the server runs as
N replicas on Ray Serve instead (quasar.cli.serve_ray); without it Ray is never imported.
"""

from __future__ import annotations

from quasar.cli.args import add_decoding_args, add_model_args
from quasar.cli.serve_args import add_serve_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (with a playground)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics "
                                   "and a playground page at /. Requests are decoded one at a time from a "
                                   "bounded queue; the speculative flags below are the per-request defaults "
                                   "(a request may override drafter, verifier and num_draft).")
    add_model_args(p)
    add_decoding_args(p)
    add_serve_args(p)
    p.set_defaults(handler="quasar.cli.serve_run:run_serve")
