"""The one exception type the CLI turns into a clear message and a non-zero exit."""


class OnecatError(Exception):
    """A user-facing error: the message names the file, module or field and how to fix it."""
