"""The exceptions of the Pythonic layer (the native module raises these classes).

Each derives from :class:`tcpx.Error` and from the builtin a Python user would catch for
the same situation, so ``except TimeoutError`` or ``except ConnectionError`` work too.
"""


class Error(Exception):
    """Base class of every tcpx failure: the message says what failed and where."""


class TransferTimeout(Error, TimeoutError):
    """A transfer or a wait ran out of time (a wait's transfer keeps running)."""


class PeerLost(Error, ConnectionError):
    """The peer closed the connection, went away, or could not be reached."""


class AccessRefused(Error, PermissionError):
    """The peer refused a one-sided operation: unknown or revoked advertisement, wrong key,
    or a range outside the advertised registration. Nothing was written or read."""


class BadArgument(Error, ValueError, RuntimeError):
    """An unusable argument: unknown id, a pointer or size outside its registration, a
    wrong-length or corrupted blob, a non-contiguous array... Also a ``RuntimeError``:
    UCCL's p2p raises that for the same mistakes, so its scripts' ``except`` clauses work."""


class UnsupportedMemory(Error, TypeError):
    """Memory (or an operation) this plugin or machine does not support, e.g. a CUDA tensor
    without a CUDA driver."""


class Closed(Error):
    """The endpoint or connection was closed by this side, or the endpoint was inherited
    through fork() (it belongs to the parent; create one in the child)."""


__all__ = [
    "Error",
    "TransferTimeout",
    "PeerLost",
    "AccessRefused",
    "BadArgument",
    "UnsupportedMemory",
    "Closed",
]
