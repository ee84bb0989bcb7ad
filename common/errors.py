"""One error type for user mistakes: raised deep, printed as one line with exit code 2 by the CLI."""


class UserError(Exception):
    """Bad input from the user (config, flags, files). The message is shown as is, without a traceback."""

    exit_code = 2


class ParityError(Exception):
    """A parity verdict failed under --strict."""

    exit_code = 3
