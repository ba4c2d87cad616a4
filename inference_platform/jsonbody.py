"""Parsing a client's JSON without letting its shape crash the server.

``json.loads`` raises ``RecursionError`` on nesting a few thousand levels deep (a 6 KB body
does it): not a ``ValueError``, so every caller that turned bad JSON into a 400 let it through
as a 500. :func:`loads` reports it as bad JSON; :class:`JSONParser` does the same for DRF.
"""

from __future__ import annotations

import json

from rest_framework import parsers
from rest_framework.exceptions import ParseError

TOO_DEEP = "the JSON is nested too deeply"


def loads(data: str | bytes):
    """``json.loads``; nesting too deep raises ``ValueError`` like any other invalid JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON parse error - {TOO_DEEP}") from None
