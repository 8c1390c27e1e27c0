"""`{name:anypath}`: Starlette's `path` convertor, newlines included.

`path` is the regex `.*`, and `.` does not match a newline, so a catch-all
segment holding one (`/api/v1/timers/q/a%0Ab`) matched no route and answered
Starlette's plain-text 404 instead of reaching the handler. A timerKey or a
transactionId is any text; the handler decides what it may hold.
"""

from __future__ import annotations

from starlette.convertors import Convertor, register_url_convertor


class AnyPathConvertor(Convertor[str]):
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return str(value)

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("anypath", AnyPathConvertor())
