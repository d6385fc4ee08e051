"""Incremental text of a growing token sequence, with stop strings.

:class:`IncrementalText` turns the tokens of one generated sequence, as they arrive, into text
pieces that never change afterwards: each new token is decoded together with a few tokens
before it (a window starting at ``prefix_offset``), and only the text beyond the window's
earlier decode is new. Decoding only a window keeps the cost per token constant; decoding it
with the tokens before keeps what a tokenizer does at token boundaries (byte-level merges,
sentencepiece's leading spaces); text that ends in an incomplete UTF-8 character (U+FFFD) is held
until the character completes.

A fast tokenizer (``tokenizers`` backend) that applies no clean-up of tokenization spaces is
decoded by its Rust backend directly: the same text as ``tokenizer.decode`` (which then only
converts its arguments and calls the backend) without that wrapper's Python per call, which the
event loop pays twice per update of every stream. Any other tokenizer goes through ``decode``.

Stop strings: the text is cut where the first stop string begins (the stop string itself is not
part of the result, as in OpenAI's API), and the sequence is finished. While streaming, the last
``len(longest stop string) - 1`` characters are held back, since they might be the start of a
stop string that the next tokens complete.
"""

from __future__ import annotations

from typing import Any, Iterable


class IncrementalText:
    """The text of one generated sequence, built token by token."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend_decoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found: the text ends before it
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters of text handed out by take()

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> None:
        """Append generated tokens (ignored once a stop string was found). Without stop strings:
        one window decode per call, whatever the number of tokens; with them, one per token, so
        the sequence ends at the token that completes a stop string (what ``num_tokens`` counts)
        however the tokens were grouped."""
        if self.stopped:
            return
        if self.stop:
            for t in token_ids:
                self.token_ids.append(int(t))
                self._advance(final=False)
                if self.stopped:
                    return
            return
        before = len(self.token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        if len(self.token_ids) > before:
            self._advance(final=False)

    def finish(self) -> None:
        """The sequence ended: decode what was held back for an incomplete character."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            self._advance(final=True)

    def _advance(self, final: bool) -> None:
        ids = self.token_ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        now = self._decode(ids[self._prefix_offset :])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return
        searched_from = max(0, len(self.text) - self._hold)
        self.text += now[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self.stop:
            found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = True

    def take(self, finished: bool) -> str:
        """The text not handed out yet; unless ``finished`` (or stopped), the tail that could still
        become a stop string is held back."""
        end = len(self.text) if finished or self.stopped else max(self._sent, len(self.text) - self._hold)
        piece = self.text[self._sent : end]
        self._sent = end
        return piece

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def backend_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` under a fast tokenizer whose ``decode`` is exactly the backend's
    (no clean-up of tokenization spaces); None otherwise."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend
