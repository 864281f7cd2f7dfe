"""Streamed text split into content, sent as it comes, and tool calls, sent once complete.

Content is passed on until something that may start a call shows up (a ``<tool_call>`` tag or
a prefix of one at the end of the text so far, a reply that starts with ``{`` in the Llama 3.x
format); from there the text is held. Harmony marks its channels with special tokens the
streamed text does not show, so its whole reply is held. At the end the reply (decoded with
its special tokens) is parsed, and the content not sent yet goes out with the calls.
"""

from __future__ import annotations

from typing import Optional

from p2pserve.client.tools.formats import ToolCall
from p2pserve.client.tools.requests import ToolRequest

_HERMES_TAG = "<tool_call>"


class ToolStream:
    """Feed text pieces; :meth:`feed` returns the content to send now, :meth:`finish` the rest
    of the content and the calls."""

    def __init__(self, request: ToolRequest, fmt: Optional[str]):
        self.request, self.fmt = request, fmt
        self.text = ""  # every piece so far
        self.sent = 0  # characters of it sent as content
        self.held = request.choice in ("required", "named") or fmt == "harmony"

    def feed(self, piece: str) -> str:
        """The content of ``piece`` that may go out now."""
        self.text += piece
        if self.held:
            return ""
        cut = self._safe_end()
        out, self.sent = self.text[self.sent:cut], max(self.sent, cut)
        return out

    def _safe_end(self) -> int:
        text = self.text
        if self.fmt == "llama3":
            stripped = text.lstrip()
            if not stripped or stripped.startswith(("{", "<|python_tag|>")):
                self.held = bool(stripped)
                return self.sent
            return len(text)
        if self.fmt == "hermes":
            at = text.find(_HERMES_TAG)
            if at >= 0:
                self.held = True
                return at
            for k in range(min(len(_HERMES_TAG) - 1, len(text)), 0, -1):  # a tag may be starting
                if _HERMES_TAG.startswith(text[-k:]):
                    return len(text) - k
        return len(text)

    def finish(self, full_text: str) -> tuple[str, list[ToolCall]]:
        """The content still to send and the calls, from the whole reply ``full_text`` (decoded
        with special tokens)."""
        content, calls = self.request.calls(full_text, self.fmt)
        if not calls:
            return self.text[self.sent:], []
        return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls
