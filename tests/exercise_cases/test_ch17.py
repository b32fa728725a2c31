"""Chapter 17: a reader's acceptance rule and rollback (accept, commit, rollback, cut_at_stop), plugged in as
spec_acceptor_cls."""

from minivllm.config import cdiv
from minivllm.exercises import check_spec_acceptor
from minivllm.spec_decode import SpecAcceptor

from exercise_cases import Check


class MySpecAcceptor(SpecAcceptor):
    """The solution notebook's answer."""

    def accept(self, draft, target):
        n = 0
        while n < len(draft) and draft[n] == target[n]:
            n += 1
        return draft[:n] + [target[n]]

    def commit(self, seq, tokens, append):
        for i, token in enumerate(tokens):
            if append(token):
                return
            if i < len(tokens) - 1:
                seq.cached_token_count += 1
                self.block_manager.register_computed_blocks(seq)
        self.rollback(seq, seq.cached_token_count)

    def rollback(self, seq, num_tokens):
        bm = self.block_manager
        keep = cdiv(num_tokens, bm.block_size)
        for block in reversed(seq.block_table[keep:]):
            bm.release(block)
        del seq.block_table[keep:]

    def cut_at_stop(self, seq, new_tokens, i):
        seq.drop_last_tokens(len(new_tokens) - i - 1)
        return new_tokens[:i + 1]


class AcceptsEveryMatch(MySpecAcceptor):
    def accept(self, draft, target):  # keeps each draft that matches, also after a mismatch
        return [d for d, t in zip(draft, target) if d == t] + [target[len(draft)]]


class NoBonus(MySpecAcceptor):
    def accept(self, draft, target):
        return super().accept(draft, target)[:-1] or [target[0]]


class BonusFromLastRow(MySpecAcceptor):
    def accept(self, draft, target):
        kept = super().accept(draft, target)
        return kept[:-1] + [target[-1]]


class NoRollback(MySpecAcceptor):
    def rollback(self, seq, num_tokens):
        pass


class RollbackFloor(MySpecAcceptor):
    def rollback(self, seq, num_tokens):  # rounds down: also releases the partly filled block of accepted tokens
        super().rollback(seq, num_tokens // self.block_manager.block_size * self.block_manager.block_size)


class CountsTheBonus(MySpecAcceptor):
    def commit(self, seq, tokens, append):  # the bonus token's KV counted as written: a block with a rejected slot
        for token in tokens:
            if append(token):
                return
            seq.cached_token_count += 1
            self.block_manager.register_computed_blocks(seq)
        self.rollback(seq, seq.cached_token_count - 1)


class CountsBeforeAppending(MySpecAcceptor):
    """The issue's commit: the accepted drafts counted and their blocks registered before the tokens are appended."""

    def commit(self, seq, tokens, append):
        seq.cached_token_count += len(tokens) - 1
        self.block_manager.register_computed_blocks(seq)
        for token in tokens:
            if append(token):
                return
        self.rollback(seq, seq.cached_token_count)


class RegistersBeforeEachAppend(MySpecAcceptor):
    """The same slip token by token: each draft counted and registered just before its own append."""

    def commit(self, seq, tokens, append):
        for i, token in enumerate(tokens):
            if i < len(tokens) - 1:
                seq.cached_token_count += 1
                self.block_manager.register_computed_blocks(seq)
            if append(token):
                return
        self.rollback(seq, seq.cached_token_count)


class RollbackKeepsTheTable(MySpecAcceptor):
    """The blocks go back to the pool, but seq.block_table still names them."""

    def rollback(self, seq, num_tokens):
        bm = self.block_manager
        for block in reversed(seq.block_table[cdiv(num_tokens, bm.block_size):]):
            bm.release(block)


class NeverCountsDrafts(MySpecAcceptor):
    def commit(self, seq, tokens, append):
        for token in tokens:
            if append(token):
                return
        self.rollback(seq, seq.cached_token_count)


class IgnoresTheEnd(MySpecAcceptor):
    def commit(self, seq, tokens, append):  # appends the whole run, whatever append says
        finished = False
        for i, token in enumerate(tokens):
            finished = append(token) or finished
            if not finished and i < len(tokens) - 1:
                seq.cached_token_count += 1
                self.block_manager.register_computed_blocks(seq)
        if not finished:
            self.rollback(seq, seq.cached_token_count)


class KeepsAfterStop(MySpecAcceptor):
    def cut_at_stop(self, seq, new_tokens, i):
        return new_tokens


class DropsTheStopToken(MySpecAcceptor):
    def cut_at_stop(self, seq, new_tokens, i):
        seq.drop_last_tokens(len(new_tokens) - i)
        return new_tokens[:i]


CHECKS = [Check("17", check_spec_acceptor, [MySpecAcceptor], {
    "accepts past the first mismatch": (AcceptsEveryMatch, "accepted past the first mismatch"),
    "forgets the bonus token": (NoBonus, "forgot the bonus token"),
    "bonus from the last row": (BonusFromLastRow, r"must be target\[1\]"),
    "leaves rejected slots claimed": (NoRollback, "leaving rejected slots claimed"),
    "releases a block of accepted tokens": (RollbackFloor, "released a block that still holds accepted tokens"),
    "caches a block with rejected tokens": (CountsTheBonus, "caching a block with rejected tokens"),
    "accepted drafts never counted": (NeverCountsDrafts, "count it"),
    "counts and registers before appending": (CountsBeforeAppending, (
        "registering computed blocks before appending the tokens", r"block 1 \(positions 4..7\)",
        "Append each token first")),
    "registers each draft before its append": (RegistersBeforeEachAppend, (
        "registering computed blocks before appending the tokens", "Append each token first")),
    "rollback keeps the blocks in the table": (RollbackKeepsTheTable, (
        "went back to the pool", "still in seq.block_table", r"del seq.block_table\[keep:\]")),
    "overshoots max_tokens": (IgnoresTheEnd, "overshooting max_tokens"),
    "keeps the tokens after a stop string": (KeepsAfterStop, "a stop string inside the accepted run"),
    "drops the stop string's token": (DropsTheStopToken, "stays"),
}, passes="the live engine")]
