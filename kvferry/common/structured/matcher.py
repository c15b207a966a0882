"""A sequence's progress through its constraint: an xgrammar matcher, rebuilt from the grammar and the tokens.

The matcher is never sent anywhere. Wherever a sequence continues (the decode worker after a prefill, another
worker after a move, a choice sampled from shared logits), a fresh matcher replays the tokens generated so far;
preemption and recompute keep the sequence, and its matcher with it.
"""

from kvferry.common.errors import InvalidRequest


class ConstraintState:
    def __init__(self, compiled, token_ids: list[int] = ()):
        import xgrammar

        self.compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)
        for i, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                raise InvalidRequest(f"the output so far breaks its constraint at token {i} (id {token_id})")

    def again(self, token_ids: list[int]) -> "ConstraintState":
        """A fresh state of the same grammar after these tokens: another choice's, from the same prompt."""
        return ConstraintState(self.compiled, token_ids)

    def fill(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into row `row` of an xgrammar bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and no change) when the constraint does not allow it: every token
        was masked out, a dead end."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The constraint is complete and its stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()
