"""Quasar: faster LLM decoding without training.

N-gram drafts from the text itself, verified in one forward pass of an INT8 (W8A8) copy of
the model; rejection sampling keeps the output exactly the verifier's distribution.
"""

from quasar.errors import QuasarError

__version__ = "0.1.0"
__all__ = ["LLM", "QuasarError", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from quasar.api import LLM  # lazy: keeps `import quasar` light (torch loads on first use of LLM)

        return LLM
    raise AttributeError(name)
