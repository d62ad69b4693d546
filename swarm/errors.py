"""Errors a volunteer can act on.

Every error the engine raises on purpose is a ``SwarmError`` whose message is one
paragraph saying what went wrong and what to do. The client prints it without a
traceback; anything else is a bug.
"""


class SwarmError(Exception):
    """An error with a message meant for the person running the peer."""


class NetworkConfigError(SwarmError):
    """A multiaddr, host or port that cannot be used."""


class BootstrapError(SwarmError):
    """None of the initial peers answered."""


class ManifestError(SwarmError):
    """A manifest that is invalid, missing, or does not match its run id."""


class StateDownloadError(SwarmError):
    """No peer could provide a verified copy of the training state."""
