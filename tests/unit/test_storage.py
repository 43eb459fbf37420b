"""Storage's terminal: a request that failed is reported once by the caller, so the
orphaned aiohttp writer task asyncio logs after it is not a second traceback."""

from __future__ import annotations

import logging

from aiohttp.client_exceptions import ClientConnectionResetError

import ulysses_mm.core.storage  # noqa: F401  (installs the asyncio filter)


def _record(exc: BaseException, msg: str) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, "", 0, msg, None, (type(exc), exc, None))


def test_an_orphaned_aiohttp_write_is_not_a_second_traceback():
    orphan = "Task exception was never retrieved\nfuture: <Task finished name='Task-56'>"
    asyncio_log = logging.getLogger("asyncio")
    assert not asyncio_log.filter(_record(ClientConnectionResetError("closing"), orphan))
    assert asyncio_log.filter(_record(ValueError("ours"), orphan))  # anything else still shows
    assert asyncio_log.filter(_record(ClientConnectionResetError("closing"), "other"))
