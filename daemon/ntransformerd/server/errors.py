"""What can go wrong with a request, as domain errors. servicer.STATUS_CODES maps them to gRPC."""

MAX_SHOWN_CHARS = 40  # of a client's value quoted back in an error message


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A client's value for an error message: its repr, or for a long one the start of it and
    its length, so an error never carries the client's input back whole."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class ServiceError(Exception):
    """Base: the message is shown to the client as is, so it names the cause and the fix."""


class InvalidRequest(ServiceError):
    """The request itself is wrong (bad number, unknown model, prompt too long). field: the
    request field at fault as the proto names it ("max_tokens", "constraint.json_schema"), where
    one is: the servicer sends it to the client beside the message (ntx_client FieldError)."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class NotReady(ServiceError):
    """No model is loaded yet, or one is loading."""


class QueueFull(ServiceError):
    """Every slot is busy and the wait queue is full."""


class Draining(ServiceError):
    """The daemon is stopping or draining and admits no new requests."""


class ShuttingDown(ServiceError):
    """An in-flight request was cancelled because the daemon is stopping."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it finished."""


class Cancelled(ServiceError):
    """The client went away or cancelled."""


class EngineFailed(ServiceError):
    """The engine raised while running this request's batch; the daemon keeps serving."""


class ModelFault(ServiceError):
    """The loaded model produced logits no token can be drawn from (NaN, infinity): the model or
    its backend is broken. The request fails, and the daemon stops serving that model until a
    good one is loaded."""


class StorageUnavailable(ServiceError):
    """The storage the model streams from (the NVMe drive) failed under this request; the daemon
    brings it up again and serves once it is back."""
