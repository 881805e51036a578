"""Errors for input that cannot work. The CLI prints their message alone, without a traceback."""


class ConfigError(ValueError):
    """A config value, path or file that cannot work; raised before weights load."""
