"""JSON payloads carried in bytes fields (native sampling params, weight-transfer info)."""

from __future__ import annotations

import json
from typing import Any

from rlserve.errors import InvalidRequest, LimitExceeded


def parse_json(raw: bytes, field: str, limit: tuple[str, int]) -> Any:
    """Any JSON value, or InvalidRequest naming `field`: larger than `limit` (its name and
    bytes), not UTF-8, not JSON, or nested too deeply for the parser."""
    limit_name, max_bytes = limit
    if len(raw) > max_bytes:
        raise LimitExceeded(field, len(raw), "bytes", limit_name, max_bytes)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(field, f"not valid JSON: {e}") from e
    except RecursionError:
        raise InvalidRequest(field, "JSON nested too deeply") from None


def parse_json_object(raw: bytes, field: str, limit: tuple[str, int]) -> dict[str, Any]:
    """A JSON object, or InvalidRequest naming `field`."""
    value = parse_json(raw, field, limit)
    if not isinstance(value, dict):
        raise InvalidRequest(field, "must be a JSON object")
    return value
