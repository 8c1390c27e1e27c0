"""The HTTP server's own refusals in the documented JSON shape.

uvicorn answers a request it cannot parse (a malformed request line, or
a request head over the parser's limit: e.g. a path with a megabyte-long
timerKey) with a plain-text 400 before the app sees it. These protocol
classes say the same thing as {"error", "detail"}.

The broker serves HTTP with JsonErrorHttpToolsProtocol (uvicorn's httptools
protocol: the llhttp parser, in C). llhttp itself puts no bound on a
request line or a header; this class refuses a request head (request line
plus headers) over MAX_HEAD_BYTES, the limit h11 applies by default, so that
a client can neither make the broker buffer an unbounded head nor see a
different limit than before. JsonErrorH11Protocol is the pure-Python h11
equivalent (uvicorn's default parser), kept for the tests that compare them.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 16 * 1024  # h11's max_incomplete_event_size default, uvicorn's h11 limit

BAD_REQUEST_BODY = json.dumps({
    "error": "timers_bad_request",
    "detail": "the request is not valid HTTP/1.1, or its request line and headers are over "
              "16 KiB (a path carries a queue of at most 255 bytes and a timerKey of at most 1024)",
}).encode()


class HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops and raises HttpParserCallbackError."""


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    _head_bytes = 0
    _head_open = False  # a request has begun and its headers are not complete
    _raw_head = 0       # bytes received while a head stayed open

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        self._head_open = True
        self._raw_head = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._head_open = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        # httptools buffers a header's name or value until it ends, so on_header
        # alone would let a header that never ends grow without bound: count the
        # bytes of every chunk after which the head is still open.
        super().data_received(data)
        if self._head_open and not self.transport.is_closing():
            self._raw_head += len(data)
            if self._raw_head > MAX_HEAD_BYTES:
                self.send_400_response("request head too large")

    def on_url(self, url: bytes) -> None:  # called once per chunk of the request target
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:  # overrides uvicorn's text/plain answer
        if self.transport.is_closing():
            return
        self.transport.write(b"".join([
            b"HTTP/1.1 400 Bad Request\r\n",
            *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(BAD_REQUEST_BODY)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            BAD_REQUEST_BODY,
        ]))
        self.transport.close()


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
