"""JSON payloads carried in bytes fields (native sampling params, weight-transfer info)."""

from __future__ import annotations

import json
from typing import Any

from rlserve.errors import InvalidRequest


def parse_json_object(raw: bytes, field: str) -> dict[str, Any]:
    """A JSON object, or InvalidRequest naming `field`."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(field, f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidRequest(field, "must be a JSON object")
    return value
