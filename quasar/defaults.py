"""Defaults shared by the API, CLI and server (no heavy imports: `quasar --help` stays fast)."""

DEFAULT_DRAFTER = "ngram"
DEFAULT_VERIFIER = "w8a8"
DEFAULT_CONTEXT = 8192
DEFAULT_NUM_DRAFT = 5
