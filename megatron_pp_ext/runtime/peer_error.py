"""The error of a rank whose exchange with a peer failed or timed out (p2p.py, creation.py)."""


class PeerError(RuntimeError):
    """A transfer with another pipeline rank failed or timed out; the message names this rank,
    what it waited at and the peer."""
