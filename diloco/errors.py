"""The one error hierarchy of the project.

Core code raises these; the RPC layer maps each class to a gRPC status code with one
table (``diloco.rpc.STATUS_FOR_ERROR``), and the CLI prints them without a traceback.
Expected outcomes (a late push that joins the next round) are results, not errors.
"""


class DilocoError(Exception):
    """Base class of every error the project raises on purpose."""


class InvalidArgument(DilocoError):
    """Malformed input: bad flag, bad payload, shape mismatch. Never retried."""


class CodecError(InvalidArgument):
    """An encoded tensor failed validation (length, shape, block size, checksum, scales)."""


class Unauthenticated(DilocoError):
    """Missing or invalid credential."""


class PermissionDenied(DilocoError):
    """Valid credential, but not allowed to do this."""


class NotFound(DilocoError):
    """Unknown learner, fragment, snapshot or run directory."""


class FailedPrecondition(DilocoError):
    """The request is well-formed but the state does not allow it (future version, lease expired)."""


class AlreadyExists(DilocoError):
    """The thing being created exists (a snapshot already running)."""


class ResourceExhausted(DilocoError):
    """Over a limit: message size, learner cap, queue depth."""


class Unavailable(DilocoError):
    """Draining or shutting down; the caller may retry elsewhere or later."""


class DeadlineExceeded(DilocoError):
    """Waited longer than the operation's bound (a shard busy with one fragment too long)."""


class Cancelled(DilocoError):
    """Stopped on purpose before it finished (a drain or a signal while starting)."""
