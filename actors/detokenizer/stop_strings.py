"""Stop strings found as the output grows, at a cost per new character rather than per
stop string length: StopStrings keeps, for each stop string, how much of its beginning the
output currently ends with (one Knuth-Morris-Pratt state a stop string), advanced by each
new character. That answers the detokenizer's two questions at every token: did a stop
string just complete, and how many trailing characters might still grow into one (held
back from the stream). Asking them by comparing every prefix of every stop string with the
output's end cost O(stops x length^2) a token: 60 stop strings of 900 characters, 23 ms of
the detokenizer's one thread per token of every such request; this costs a few us."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        assert all(stops), "stop strings are non-empty (SamplingParams checks it)"
        self.stops = stops
        self.failure = [_failure_table(stop) for stop in stops]
        self.states = [0] * len(stops)  # per stop string: how many of its first characters the output ends with
        self.active: set[int] = set()  # the stop strings whose state is not 0
        self.by_first: dict[str, list[int]] = {}  # a first character -> the stop strings it begins
        for index, stop in enumerate(stops):
            self.by_first.setdefault(stop[0], []).append(index)
        self.completed: set[int] = set()  # the stop strings that ended inside the last feed()

    def feed(self, text: str) -> None:
        """Advances past text, what the output added."""
        stops, failure, states, active = self.stops, self.failure, self.states, self.active
        self.completed = set()
        for char in text:
            for index in list(active):
                stop, state = stops[index], states[index]
                if state == len(stop):  # a whole match already: go on as the text does
                    state = failure[index][state]
                while state and stop[state] != char:
                    state = failure[index][state]
                state = state + 1 if stop[state] == char else 0
                states[index] = state
                if state == len(stop):
                    self.completed.add(index)
                elif not state:
                    active.discard(index)
            for index in self.by_first.get(char, ()):
                if not states[index]:
                    states[index] = 1
                    active.add(index)
                    if len(stops[index]) == 1:
                        self.completed.add(index)

    def held_back(self) -> int:
        """The most trailing characters that begin a stop string without completing it."""
        return max((self._open_state(index) for index in self.active), default=0)

    def _open_state(self, index: int) -> int:
        state = self.states[index]
        # a stop string the output just completed: the longest of its beginnings that ends it too
        return self.failure[index][state] if state == len(self.stops[index]) else state


def _failure_table(stop: str) -> list[int]:
    """KMP's: failure[k] is the length of the longest proper prefix of stop[:k] that is also its suffix."""
    failure = [0] * (len(stop) + 1)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k]
        if stop[i] == stop[k]:
            k += 1
        failure[i + 1] = k
    return failure
