"""The HTTP access log without secrets: a key in a URL's query (`/dashboard?key=KEY`) is
replaced before uvicorn's access line is formatted, so keys never reach log files."""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER_NAME = "uvicorn.access"
REDACTED = "<redacted>"
# Query parameters that carry credentials.
_SECRET_QUERY = re.compile(r"(?i)([?&;](?:key|api_key|apikey|token|access_token|auth|password)=)[^&;#\s]*")


def redact_url(url: str) -> str:
    """`url` with the values of its credential query parameters replaced."""
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, url) if "?" in url else url


class SecretsRedacted(logging.Filter):
    """Rewrites the path argument of uvicorn's access record:
    ('%s - "%s %s HTTP/%s" %d', client, method, path_with_query, http_version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_url(args[2]), *args[3:])
        return True


def redact_access_log(logger: logging.Logger | None = None) -> None:
    """Install the filter on uvicorn's access logger (once, however many apps are built)."""
    logger = logger or logging.getLogger(ACCESS_LOGGER_NAME)
    if not any(isinstance(f, SecretsRedacted) for f in logger.filters):
        logger.addFilter(SecretsRedacted())
