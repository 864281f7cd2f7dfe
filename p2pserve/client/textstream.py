"""Turning a token stream into text pieces: incomplete UTF-8 and stop strings. Pure logic.

Byte-level BPE tokens can split a multi-byte character; decoding such a prefix yields U+FFFD,
so text is held back until it decodes cleanly. Text that could be the start of a stop string is
held back too, so a stop string never leaks into the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


class IncrementalDetokenizer:
    """Decodes a stream of token ids into newly completed text, at a bounded cost per token.

    Decoding the whole reply again for every token costs O(length) per token. Instead only a
    short window is decoded: the tokens not shown yet, after the group of tokens shown last,
    whose text is known. A decoder that changes a token's text by its neighbours (a leading
    space dropped at the start of a decode) does it to both decodes alike, so the difference is
    the new text, as in a decode of the whole reply.

    A fast tokenizer whose text ``transformers`` leaves as its Rust backend decodes it (no
    clean-up of spaces) runs this in the backend itself (``tokenizers``' ``DecodeStream``, the
    same algorithm); the window here is then only kept for :meth:`flush`, and takes over if the
    stream ever refuses a token (a decoder that rewrote text already shown).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._backend, self._stream = _decode_stream(tokenizer, skip_special_tokens)
        self._ids: list[int] = []  # the window: the group shown last, then the tokens not shown yet
        self._shown = 0  # ids[:_shown] is that group
        self._shown_text: Optional[str] = ""  # its text decoded alone (None: not decoded yet)

    def push(self, token: int) -> str:
        """Add one token; return the text that became final with it (maybe empty)."""
        self._ids.append(token)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token)
            except Exception:  # the decoder rewrote text already shown: go on in the window
                self._stream = None
            else:
                if piece is not None:
                    self._slide(None)
                return piece or ""
        return self._window_piece(final=False)

    def flush(self) -> str:
        """Text still held back at the end (an unfinished character is emitted as U+FFFD)."""
        return self._window_piece(final=True) if len(self._ids) > self._shown else ""

    def _window_piece(self, final: bool) -> str:
        """The window's new text; "" while there is none, or (unless ``final``) while it ends
        in an incomplete UTF-8 sequence."""
        shown = self._shown_text
        if shown is None:
            shown = self._decode(self._ids[:self._shown]) if self._shown else ""
        text = self._decode(self._ids)
        if len(text) <= len(shown) or (text.endswith("\ufffd") and not final):
            self._shown_text = shown
            return ""
        # If a decoder's clean-up rewrote the shown part, what was shown stays shown: continue
        # from the new text's end.
        self._slide(self._decode(self._ids[self._shown:]))
        return text[len(shown):]

    def _slide(self, text: Optional[str]) -> None:
        """The tokens not shown until now become the shown group (``text``: theirs, if known)."""
        del self._ids[:self._shown]
        self._shown = len(self._ids)
        self._shown_text = text


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode`` gives it: a fast tokenizer's Rust backend when
    ``transformers`` adds nothing to it, else the tokenizer itself."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _plain_backend(tokenizer):
    """The Rust tokenizer behind ``tokenizer`` when its decode is ``tokenizer.decode``'s (no
    clean-up of spaces on top), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def _decode_stream(tokenizer, skip_special_tokens: bool) -> tuple:
    """(backend, ``DecodeStream``) for a plain fast tokenizer, else (None, None) (also with a
    ``tokenizers`` too old to have it)."""
    backend = _plain_backend(tokenizer)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None, None
    if backend is None:
        return None, None
    return backend, DecodeStream(skip_special_tokens=skip_special_tokens)


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
