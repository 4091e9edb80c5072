"""The `quasar` command. The library never imports this package."""

from quasar.cli.main import main

__all__ = ["main"]
