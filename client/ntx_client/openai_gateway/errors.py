"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status.

Every way a request can fail ends up as one APIError, and from_ntx() is the one place a daemon
error (its gRPC status code) becomes an HTTP status.
"""

from __future__ import annotations

import grpc

from ntx_client.client import FieldError
from ntx_client.errors import NtxError

# The `type` OpenAI's own server puts in its error objects for each status.
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error",
         500: "server_error", 503: "server_error", 504: "server_error"}

# gRPC status of a daemon error → HTTP status. The daemon answers FAILED_PRECONDITION while its
# model loads (or when none is loaded) and UNAVAILABLE while draining or unreachable: both are
# "come back later", which HTTP says with 503.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.PERMISSION_DENIED: 503,  # the gateway's own access to the daemon: not the caller's fault
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class APIError(Exception):
    """A request that cannot be served; `body()` is what the client receives."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after else {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


SHOWN_CHARS = 64  # of a client's own text echoed in an error


def shown(text: str) -> str:
    """`text` for an error message: its first SHOWN_CHARS characters, and how long it was."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


# The `code` of an error the daemon answered, by HTTP status
CODES = {400: "invalid_value", 404: "not_found", 429: "rate_limit_exceeded", 500: "server_error",
         503: "service_unavailable", 504: "timeout"}


def from_ntx(err: NtxError, param=None) -> APIError:
    """The APIError for an error the daemon (or reaching it) raised. param: the request's
    parameter behind a daemon's field (protocol.Job.param), where the daemon named one."""
    status = HTTP_STATUS.get(err.code, 500)
    message = str(err)
    # the client library prefixes the gRPC code name; the HTTP status already says it
    if err.code is not None and message.startswith(f"{err.code.name}: "):
        message = message[len(err.code.name) + 2:]
    if status == 500:
        message = f"ntransformerd failed: {message}"
    field = err.field if isinstance(err, FieldError) else None
    return APIError(status, message, param=param(field) if param is not None and field else field,
                    code=CODES.get(status, "server_error"), retry_after=1 if status in (429, 503) else None)
