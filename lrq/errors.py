"""Errors the user can fix. The CLI prints them as one paragraph and exits with code 2."""


class UserError(Exception):
    """Bad input: a model, scheme, option or data folder that cannot work. The message says how to fix it."""
