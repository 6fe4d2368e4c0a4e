"""The HTTP server under the gateway: uvicorn, with every part of reading a request bounded.

uvicorn's own settings bound most of it: the size of a request head
(`h11_max_incomplete_event_size`), the idle time of a kept-alive connection between requests
(`timeout_keep_alive`) and the connections and requests served at once (`limit_concurrency`;
past it, 503). What no uvicorn setting bounds is the time a client takes to send its request:
the keep-alive timer runs only between requests and stops at their first byte, and no timer
runs before a connection's first request (uvicorn's issue 157 lists the missing
--timeout-request-start), so a client that sends a header line now and then, or a body byte,
holds its connection, and a place under the concurrency limit, for ever.

`DeadlineH11Protocol` is uvicorn's h11 protocol with that one bound added: the request head
must arrive within `header_timeout` of the connection (or of a kept-alive request's first
byte), and the body within `body_timeout` of the head; otherwise the connection is closed, as
uvicorn's keep-alive timer closes an idle one. A request fully received is no longer timed, so
a long streamed answer is never cut.

Thread rule: protocols live on the server's event loop, one per connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ntx-openai")

KEEP_ALIVE_S = 5  # idle time of a kept-alive connection between requests (uvicorn's default)
MAX_HEADER_BYTES = 16 << 10  # request line and headers (h11's default, stated here)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on receiving each request (see the module)."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self._receiving = None  # h11.IDLE (the head) or h11.SEND_BODY (the body) while timed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(h11.IDLE)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state  # where h11 stands in the client's request after these bytes
        if state is h11.IDLE or state is h11.SEND_BODY:
            if self._receiving is not state:  # a new request, or its head just completed
                self._arm(state)
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, state) -> None:
        self._disarm()
        self._receiving = state
        self._deadline = self.loop.call_later(
            self.header_timeout if state is h11.IDLE else self.body_timeout, self._expired, state)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._receiving = None

    def _expired(self, state) -> None:
        self._deadline = self._receiving = None
        if self.transport.is_closing():
            return
        what, flag, seconds = (("head", "--header-timeout", self.header_timeout) if state is h11.IDLE
                               else ("body", "--body-timeout", self.body_timeout))
        peer = "%s:%d" % self.client if self.client else "a client"
        log.warning("closed the connection from %s: its request %s did not arrive within %g s (%s)", peer, what,
                    seconds, flag)
        self.transport.close()


def serve(app, *, host: str, port: int, log_level: str, header_timeout: float, body_timeout: float,
          max_connections: int) -> None:
    """Run `app` until SIGINT/SIGTERM."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                timeout_graceful_shutdown=5,
                http=functools.partial(DeadlineH11Protocol, header_timeout=header_timeout,
                                       body_timeout=body_timeout),
                timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                limit_concurrency=max_connections)
