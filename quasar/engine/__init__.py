"""Verifiers built, cached and priced: which verifier a name means, how each is built (from
the float model, a W8A8 or a W4A8 cache entry), and what a step of its rows costs."""
