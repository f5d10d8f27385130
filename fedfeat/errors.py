"""The one exception type for errors a user can cause.

The CLI prints a ``FedfeatError`` as a single line (``error: ...``) and exits with status 2;
anything else is a programming error and keeps its traceback.
"""


class FedfeatError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""
