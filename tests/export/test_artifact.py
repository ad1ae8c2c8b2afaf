"""GreedyLM.trace: greedy generation, and the same steps fed another run's tokens (parity's teacher forcing)."""

import numpy as np

from oscar_export.export.artifact import GreedyLM

VOCAB, EOS = 10, 9


class Successor(GreedyLM):
    """A runner whose next token is always the last fed token plus one; it records what it was fed."""

    max_chunk = 4

    def __init__(self):
        self.fed = []

    def step(self, ids):
        self.fed.append(list(ids))
        logits = np.zeros(VOCAB, np.float32)
        logits[(ids[-1] + 1) % VOCAB] = 1.0
        return logits


def test_greedy_feeds_its_own_tokens():
    lm = Successor()
    tokens, logits = lm.trace([0, 1], 3)
    assert tokens == [2, 3, 4] and lm.fed == [[0, 1], [2], [3]] and len(logits) == 3


def test_forced_feeds_the_given_tokens_and_reports_its_own_picks():
    lm = Successor()
    tokens, logits = lm.trace([0, 1], 3, forced=[5, 7, 2])
    assert lm.fed == [[0, 1], [5], [7]]  # the forced tokens, not its picks
    assert tokens == [2, 6, 8] and [int(np.argmax(x)) for x in logits] == tokens


def test_forced_stops_where_the_forced_run_stopped():
    lm = Successor()
    assert lm.trace([0], 8, eos_token_ids=(EOS,), forced=[4, EOS])[0] == [1, 5]  # fed EOS: no step after it
    assert lm.fed == [[0], [4]]
    assert Successor().trace([0], 8, forced=[4, 6, 1])[0] == [1, 5, 7]  # at most as many steps as forced tokens
