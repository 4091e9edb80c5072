"""Verifiers built, cached and priced: which verifier a request names (`spec.VerifierSpec`),
how each is built (from the float model, a W8A8 or a W4A8 cache entry), and the `Engine`
that keeps them, prices their rows and decodes with them."""
