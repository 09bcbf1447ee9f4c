"""A generated output printed as the chain accepts it (``bt-peer generate``): the new bytes of each
traversal, decoded as they complete UTF-8 characters, so the text is what decoding the whole
output gives. Where it is written is the caller's (``write(text, newline)``: the CLI passes click's
echo, which prints the whole output too, so both print the same text)."""

from __future__ import annotations

import codecs
from typing import Callable


class StdoutClosed(Exception):
    """The reader of a streamed output went away (``| head``): not a hop's fault, nothing to retry."""


class OutputPrinter:
    """An ``on_bytes`` callback (client.py) that prints the output as it grows. A retry on another
    chain starts again from the prompt and, exact, makes the same bytes; if it does not, ``note``
    says so and the whole output is printed again."""

    def __init__(self, write: Callable[[str, bool], None], note: Callable[[str], None]):
        self.write, self.note = write, note
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.printed = b""  # the output printed so far

    def __call__(self, output: bytes, seconds: float, final: bool = False):
        if not output.startswith(self.printed) and not self.printed.startswith(output):
            at = next(i for i, (x, y) in enumerate(zip(output, self.printed)) if x != y)
            self.note(f"\n[the chain that took over wrote other bytes from byte {at}: its output follows whole]")
            self.printed, self.decoder = b"", type(self.decoder)(errors="replace")
        new = output[len(self.printed):]
        self.printed += new
        try:
            self.write(self.decoder.decode(new, final=final), final)
        except BrokenPipeError:
            raise StdoutClosed() from None
