"""JSON request bodies: one nesting limit for every entry point.

Python's json module decodes nested arrays and objects by recursion, so a body of 100,000 `[`
raises RecursionError (a 500) before any validation runs; orjson stops at 1,024 levels but then
refuses to write back more than 255. No body Tessera takes needs more than a few dozen levels (a
full v1.Pod in an AdmissionReview, managedFields included, is under 20), so every JSON body is
measured before it is decoded and refused past MAX_JSON_DEPTH: the REST API through `JSONParser`
(the default parser in settings), the extender and the admission webhook through
`controlplane.extender.wire.load_json`.

The measure reads the bytes without decoding them, at the speed of bytes methods: escaped
characters are dropped (so `\\"` is no quote), then everything but quotes and brackets; what lies
between a pair of quotes is a string's content, and the rest is brackets whose running sum is the
depth. For a filter body with 1,000 node names it costs about as much as orjson's decoding.
"""

from __future__ import annotations

import io
from itertools import accumulate
from typing import Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_JSON_DEPTH = 64

TOO_DEEP = (
    f"JSON nested deeper than {MAX_JSON_DEPTH} levels (each object or array inside another is a "
    "level); no Tessera request needs that many."
)

_NOT_MARKS = bytes(range(256)).translate(None, b'"[]{}')
_STEP = [0] * 256
for _byte in b"[{":
    _STEP[_byte] = 1
for _byte in b"]}":
    _STEP[_byte] = -1


class JSONTooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


def _without_escapes(body: bytes) -> bytes:
    """`body` with every backslash escape removed (`\\\\` and `\\"` included)."""
    if b"\\" not in body:
        return body
    parts = body.split(b"\\")
    kept = [parts[0]]
    i, n = 1, len(parts)
    while i < n:
        part = parts[i]
        if not part and i + 1 < n:  # an escaped backslash: the next part is plain text
            kept.append(parts[i + 1])
            i += 2
        else:  # the escaped character opens this part
            kept.append(part[1:])
            i += 1
    return b"".join(kept)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in the UTF-8 JSON `body` (0 for a scalar).

    Exact for valid JSON; for invalid JSON it is the depth of the valid part a decoder reads
    before it fails, or more, never less.
    """
    marks = _without_escapes(body).translate(None, _NOT_MARKS)
    if b'"' in marks:
        marks = marks.replace(b'""', b"")  # strings without brackets, and string boundaries
        if b'"' in marks:
            marks = b"".join(marks.split(b'"')[::2])  # the even pieces lie outside strings
    return max(accumulate(map(_STEP.__getitem__, marks)), default=0)


def check_json_depth(body: bytes) -> None:
    """JSONTooDeep when `body` nests deeper than MAX_JSON_DEPTH."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise JSONTooDeep


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser behind the nesting limit: a 400 naming the body, never a RecursionError."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        body = stream.read()
        try:
            utf8 = body if encoding.lower() in ("utf-8", "utf8") else body.decode(encoding).encode()
        except (LookupError, UnicodeError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        try:
            check_json_depth(utf8)
        except JSONTooDeep as exc:
            raise ParseError(str(exc)) from None
        return super().parse(io.BytesIO(body), media_type, parser_context)
