"""Turning a token stream into text pieces: incomplete UTF-8 and stop strings. Pure logic.

Byte-level BPE tokens can split a multi-byte character; decoding such a prefix yields U+FFFD,
so text is held back until it decodes cleanly. Text that could be the start of a stop string is
held back too, so a stop string never leaks into the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    """Decodes a growing list of token ids into newly completed text."""

    tokenizer: object
    skip_special_tokens: bool = True
    _ids: list[int] = field(default_factory=list)
    _emitted: str = ""

    def push(self, token: int) -> str:
        """Add one token; return the text that became final with it (maybe empty)."""
        self._ids.append(token)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        if not text.startswith(self._emitted):
            # Rare: the tokenizer's clean-up rewrote earlier text. Never re-emit what was shown;
            # continue from the new text's end.
            piece = text[len(self._emitted):] if len(text) > len(self._emitted) else ""
            self._emitted = text
            return piece
        piece = text[len(self._emitted):]
        self._emitted = text
        return piece

    def flush(self) -> str:
        """Text still held back at the end (an unfinished character is emitted as U+FFFD)."""
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        piece = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text
        return piece


@dataclass
class StopStringMatcher:
    """Cuts the text at the first stop string, holding back possible stop-string prefixes."""

    stop_strings: tuple[str, ...] = ()
    _pending: str = ""
    stopped: bool = False

    def feed(self, piece: str) -> str:
        """Add text; return what is safe to show. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        if not self.stop_strings:
            return piece
        self._pending += piece
        cut = min((i for i in (self._pending.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        hold = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
