"""One exception type for every problem a user can cause or fix.

The CLI turns a QuasarError into a one-line message and a non-zero exit; anything
else is a bug and keeps its traceback.
"""


class QuasarError(Exception):
    """A problem with the user's input, files or environment, explained in one line."""
