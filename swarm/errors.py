"""Errors a volunteer can act on.

Every error the engine raises on purpose is a ``SwarmError`` whose message is one
paragraph saying what went wrong and what to do. The client prints it without a
traceback; anything else is a bug.
"""


class SwarmError(Exception):
    """An error with a message meant for the person running the peer."""


class NetworkConfigError(SwarmError):
    """A multiaddr, host or port that cannot be used."""


class PortTakenError(NetworkConfigError):
    """The port that was asked for explicitly is in use."""


class BootstrapError(SwarmError):
    """None of the initial peers answered."""


class ManifestError(SwarmError):
    """A manifest that is invalid, missing, or does not match its run id."""


class StateDownloadError(SwarmError):
    """No peer could provide a verified copy of the training state."""


class LeaveRequested(BaseException):
    """The peer was told to leave (a stop signal). Not an error, so not an ``Exception``: like
    ``KeyboardInterrupt`` it passes through the ``except Exception`` of a round or a download."""


class SecretError(SwarmError):
    """A closed run's secret that is missing, unreadable, too short, or not this run's."""


class HelperError(SwarmError):
    """A helper process (the DHT, the averager) died or hung before it was ready, died later, or (the averager)
    kept running an averaging step past every timeout."""
