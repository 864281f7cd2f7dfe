"""Server-sent events of one streamed response, as bytes.

Nearly every chunk of a stream carries only text: its JSON is the same but for that text. So
the chunk of each choice is encoded once with a marker in place of the text and cut in two
around it, and each text chunk is the two parts around the text's JSON string (msgspec's
encoder, UTF-8 as SSE is). Every other event (the first and last chunks, usage, errors,
log-probabilities, tool calls) is a dict encoded whole.
"""

from __future__ import annotations

import json
from typing import Optional

import msgspec

from p2pserve.http.openai.schema import GenRequest, chunk_body

_encode = msgspec.json.Encoder().encode
_MARK = "\ue000p2pserve-text\ue000"  # stands for the text while a template is made
_MARK_JSON = _encode(_MARK)
DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    """One event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ChunkEncoder:
    """The events of request ``g``'s stream (response id ``rid``, ``created``)."""

    def __init__(self, g: GenRequest, rid: str, created: int):
        self.g, self.rid, self.created = g, rid, created
        self._text: dict[int, Optional[tuple[bytes, bytes]]] = {}  # choice index -> template parts

    def text(self, index: int, text: str) -> bytes:
        """The chunk of choice ``index`` carrying ``text`` alone."""
        parts = self._text.get(index, ())
        if parts == ():
            parts = self._text[index] = self._template(index)
        if parts is None:  # the marker was not found once: encode the whole chunk
            return b"data: " + _encode(chunk_body(self.g, self.rid, self.created, text=text, index=index)) + b"\n\n"
        return parts[0] + _encode(text) + parts[1]

    def _template(self, index: int) -> Optional[tuple[bytes, bytes]]:
        body = _encode(chunk_body(self.g, self.rid, self.created, text=_MARK, index=index))
        parts = body.split(_MARK_JSON)
        if len(parts) != 2:
            return None
        return b"data: " + parts[0], parts[1] + b"\n\n"
