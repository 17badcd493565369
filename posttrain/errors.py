"""User-facing errors.

A `PosttrainError` carries one line that names the file, key or value that is wrong.
The CLI prints it as `error: <message>` and exits with status 2, without a traceback.
"""


class PosttrainError(Exception):
    """Bad input from the user (a path, a file, a config key, a value)."""


class CheckpointError(PosttrainError):
    """A checkpoint file or directory that cannot be read as the model it claims to be."""


class ConfigError(PosttrainError):
    """A config file or override with an unknown key or an invalid value."""
