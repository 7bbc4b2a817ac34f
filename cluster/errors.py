"""Errors the CLI turns into one line and exit code 2."""


class UsageError(Exception):
    """A problem with what the user asked for (flags, files, addresses)."""
