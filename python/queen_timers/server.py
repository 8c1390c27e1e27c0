"""The HTTP server's own refusals in the documented JSON shape.

uvicorn answers a request it cannot parse (a malformed request line, or
a request head over h11's limit, 16 KiB by default: e.g. a path with a
megabyte-long timerKey) with a plain-text 400 before the app sees it.
This protocol class says the same thing as {"error", "detail"}.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BAD_REQUEST_BODY = json.dumps({
    "error": "timers_bad_request",
    "detail": "the request is not valid HTTP/1.1, or its request line and headers are over "
              "16 KiB (a path carries a queue of at most 255 bytes and a timerKey of at most 1024)",
}).encode()


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # overrides uvicorn's text/plain answer
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(BAD_REQUEST_BODY)).encode()),
                   (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=BAD_REQUEST_BODY)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: fall back
            super().send_400_response(msg)
            return
        self.transport.close()
