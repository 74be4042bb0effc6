"""Line stops: a request ends with the newline that closes a line holding one of some phrases (e.g. the math
preset's "The answer is X." line). Checked on the tokens alone as a row appends, so plain and speculative
decoding stop at the same token.
"""

from __future__ import annotations

from typing import Sequence

_WINDOW = 64  # tokens decoded back from a newline: a phrase further back on a longer line is not seen


class LineStop:
    """Phrases whose line, once closed by a newline, ends the request."""

    def __init__(self, phrases: Sequence[str], tokenizer) -> None:
        self.phrases = tuple(phrases)
        if any(not isinstance(p, str) or not p or "\n" in p for p in self.phrases):
            raise ValueError(f"stop lines must be non-empty one-line strings, got {self.phrases!r}")
        if self.phrases and tokenizer is None:
            raise ValueError("stop lines need a tokenizer: SpecEngine(model, tokenizer)")
        self.tokenizer = tokenizer
        self._piece: dict[int, str] = {}  # token id -> its text (decoded once per id)

    def hit(self, out: Sequence[int]) -> bool:
        """The newest token holds a newline and the line it closes holds a phrase."""
        tok = out[-1]
        piece = self._piece.get(tok)
        if piece is None:
            piece = self._piece[tok] = self.tokenizer.decode([tok])
        if "\n" not in piece:
            return False
        text = self.tokenizer.decode(list(out[-_WINDOW:]))
        line = text[:len(text) - len(piece) + piece.index("\n")].rsplit("\n", 1)[-1]
        return any(p in line for p in self.phrases)
