"""Stop strings (OpenAI's `stop`): the text ends before the first of them. While streaming, the
last len(longest stop) - 1 characters are held back, so a stop string split across outputs is
never sent in part."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1
        self.buffer = ""                    # text not yet released

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """New text -> (text to release, whether a stop string was reached). final: the request
        ended, release everything."""
        self.buffer += text
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buffer = self.buffer[:cut], ""
            return out, True
        keep = 0 if final else min(self.hold, len(self.buffer))
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer)
                                                                               - keep:]
        return out, False
