"""Documented limits on names, in UTF-8 bytes (docs/limits.md).

The HTTP shell checks them before any SQL (400 timers_bad_request); the
timer functions check the same numbers again (queen.timer_name_problem),
so a DBA's psql call gets the same refusal. A name over its limit would
otherwise reach a btree index as a row too large for it: an error of
capacity (503, "retry") for what is a malformed request.
"""

from __future__ import annotations

from .errors import bad_request, check_text

MAX_QUEUE_BYTES = 255
MAX_TENANT_BYTES = 255  # a JWT's tenant claim (auth.py)
MAX_SUB_BYTES = 255  # a JWT's sub claim, stamped as producerSub (auth.py; OpenID Connect's bound)
MAX_TIMER_KEY_BYTES = 1024
MAX_TXN_BYTES = 255
MAX_PARTITION_BYTES = 255
MAX_LOG_NAME_BYTES = 255  # consumerGroup, namespace, task
# an integer query parameter is held to a SQL integer's range before it is sent (psycopg
# sends a larger one as bigint or numeric, which no function signature takes: a 500)
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1

LIMITS: dict[str, int] = {
    "queue": MAX_QUEUE_BYTES,
    "timerKey": MAX_TIMER_KEY_BYTES,
    "after": MAX_TIMER_KEY_BYTES,       # a timerKey cursor
    "txn": MAX_TXN_BYTES,
    "transactionId": MAX_TXN_BYTES,     # the log's name for a txn
    "partition": MAX_PARTITION_BYTES,
    "consumerGroup": MAX_LOG_NAME_BYTES,  # a key of the cursors' primary key
    "namespace": MAX_LOG_NAME_BYTES,
    "task": MAX_LOG_NAME_BYTES,
}


def check_name(name: str, value: str, where: str = "") -> None:
    """400 when `value` has a NUL, is not encodable Unicode, or is over the limit of `name`."""
    if value.isascii() and "\x00" not in value:  # the common case: one byte a character, nothing to refuse
        size = len(value)
    else:
        check_text(value, f"{where}{name}")
        size = len(value.encode("utf-8"))
    limit = LIMITS[name]
    if size > limit:
        raise bad_request(f"{where}{name} is {size} bytes; at most {limit} (UTF-8)")
