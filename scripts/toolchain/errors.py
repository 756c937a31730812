"""The one exception type the tools raise for user errors."""

USAGE = 2
REFUSED = 1


class ToolError(Exception):
    """A problem the user can fix; the CLI prints it as a message, without a traceback.

    exit_code is 2 for usage errors (bad arguments, unknown version, missing tree) and
    1 when the tree itself is the problem (drift, half-applied, wrong artifact hash).
    """

    def __init__(self, message: str, exit_code: int = REFUSED):
        super().__init__(message)
        self.exit_code = exit_code
