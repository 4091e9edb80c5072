"""One exception type for every problem a user can cause or fix.

The CLI turns a QuasarError into a one-line message and a non-zero exit; the server into a
400 naming the request field in ``param``; anything else is a bug and keeps its traceback.
"""


class QuasarError(Exception):
    """A problem with the user's input, files or environment, explained in one line.

    ``param`` names the option or request field the message is about, when there is one.
    """

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param
