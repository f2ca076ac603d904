"""Errors a user can cause (paths, flags, configs, data, shapes).

Raise `UserError("what is wrong; how to fix it")`; the CLI prints it as one line and exits 2,
without a traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, stated with its fix in one line."""
