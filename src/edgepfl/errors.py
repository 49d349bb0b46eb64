"""User-facing errors.

Every mistake a user can make (a bad config value, a missing data file, a resume of a
different run) raises ``EdgepflError`` with a message that names the offending value and
what would be valid. The command line turns it into exit code 2 without a traceback.
"""


class EdgepflError(Exception):
    """An error caused by user input; its message is meant to be read by a person."""


class ConfigError(EdgepflError):
    """A configuration value is unknown or out of range."""


class DataError(EdgepflError):
    """A data set is missing, unreadable or does not fit the requested partition."""
