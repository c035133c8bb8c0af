"""Errors the user can act on.

Anything raised as a `UserError` reaches the command line as one line
`error: ...` with exit code 2 (and the window as a dialog). Everything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: a missing or corrupt model, an impossible budget, an unknown id."""


class ModelFormatError(UserError):
    """A model folder that we cannot read: missing files, bad shapes, unknown architecture."""


class BudgetError(UserError):
    """Budgets too small for what must be resident; the message says the minimum."""


class ContextFullError(UserError):
    """The conversation no longer fits the context window."""


class RemoteError(UserError):
    """A remote model's server could not answer (models add-remote); the message says why and what to do."""


class RemoteInterrupted(RemoteError):
    """A remote answer broke off midway; `partial` is the text that arrived before."""

    def __init__(self, message: str, partial: str = ""):
        super().__init__(message)
        self.partial = partial
class UnsafePickleError(UserError):
    """A PyTorch pickle that would run code (or is no state dict of tensors) was refused."""
