"""Chapter 12: a reader's DecodeGraphRunner.load (a decode step into the static buffers, padding rows included)."""

import torch

from minivllm.cuda_graphs import DecodeGraphRunner, bucket_for
from minivllm.exercises import check_graph_runner

from exercise_cases import Check


class MyGraphRunner(DecodeGraphRunner):
    """The solution notebook's answer."""

    def load(self, inputs):
        n = len(inputs.query_lens)
        b = bucket_for(n, self.sizes)
        pad, width = b - n, self.max_blocks
        rows = {self.input_ids: inputs.token_ids + [0] * pad,
                self.positions: inputs.positions + [0] * pad,
                self.slot_mapping: inputs.slot_mapping + [-1] * pad,
                self.context_lens: inputs.context_lens + [1] * pad,
                self.block_tables: [t + [0] * (width - len(t)) for t in inputs.block_tables] + [[0] * width] * pad}
        for buffer, values in rows.items():
            buffer[:b].copy_(torch.tensor(values, dtype=torch.long))
        return b


class FillsInPlace(DecodeGraphRunner):
    """Another right shape: the real rows row by row, then the padding rows filled."""

    def load(self, inputs):
        n = len(inputs.query_lens)
        b = next(size for size in self.sizes if size >= n)
        self.block_tables[:b].zero_()
        for i in range(n):
            self.input_ids[i] = inputs.token_ids[i]
            self.positions[i] = inputs.positions[i]
            self.slot_mapping[i] = inputs.slot_mapping[i]
            self.context_lens[i] = inputs.context_lens[i]
            self.block_tables[i, :len(inputs.block_tables[i])] = torch.tensor(inputs.block_tables[i])
        self.input_ids[n:b] = 0
        self.positions[n:b] = 0
        self.slot_mapping[n:b] = -1
        self.context_lens[n:b] = 1
        return b


class PadsWithSlotZero(MyGraphRunner):
    def load(self, inputs):
        b = super().load(inputs)
        self.slot_mapping[len(inputs.query_lens):b] = 0
        return b


class WritesOnlyRealRows(MyGraphRunner):
    def load(self, inputs):
        n = len(inputs.query_lens)
        for name, values in (("input_ids", inputs.token_ids), ("positions", inputs.positions),
                             ("slot_mapping", inputs.slot_mapping), ("context_lens", inputs.context_lens)):
            getattr(self, name)[:n] = torch.tensor(values)
        for i, t in enumerate(inputs.block_tables):
            self.block_tables[i, :len(t)] = torch.tensor(t)
        return bucket_for(n, self.sizes)


class NoBucket(MyGraphRunner):
    def load(self, inputs):
        super().load(inputs)
        return len(inputs.query_lens)


class NextPowerOfTwo(MyGraphRunner):
    def load(self, inputs):
        n = len(inputs.query_lens)
        b = 1 << (n - 1).bit_length()  # the captured sizes end at max_num_seqs, which need not be a power of two
        self.slot_mapping[:b].copy_(torch.tensor(inputs.slot_mapping + [-1] * (b - n)))
        super().load(inputs)
        return b


class PadsWithContextZero(MyGraphRunner):
    def load(self, inputs):
        b = super().load(inputs)
        self.context_lens[len(inputs.query_lens):b] = 0
        return b


class NewTensors(MyGraphRunner):
    def load(self, inputs):
        n = len(inputs.query_lens)
        b = bucket_for(n, self.sizes)
        slots = torch.full_like(self.slot_mapping, -1)
        slots[:n] = torch.tensor(inputs.slot_mapping)
        super().load(inputs)
        self.slot_mapping = slots  # a graph would still read the buffer it captured
        return b


class PadsTablesWithMinusOne(MyGraphRunner):
    def load(self, inputs):
        b = super().load(inputs)
        for i, t in enumerate(inputs.block_tables):
            self.block_tables[i, len(t):] = -1
        return b


class RowsReversed(MyGraphRunner):
    def load(self, inputs):
        b = super().load(inputs)
        n = len(inputs.query_lens)
        self.input_ids[:n] = torch.tensor(inputs.token_ids[::-1])
        return b


CHECKS = [Check("12", check_graph_runner, [MyGraphRunner, FillsInPlace], {
    "padding rows write slot 0": (PadsWithSlotZero, "real slot of block 0"),
    "only the real rows rewritten": (WritesOnlyRealRows, "kept the slot of an earlier step"),
    "no bucket": (NoBucket, r"smallest captured size that holds the batch"),
    "the next power of two": (NextPowerOfTwo, (r"captured sizes are \(1, 2, 4, 6\)", "the largest captured size")),
    "padding with context length 0": (PadsWithContextZero, "divides 0 by 0"),
    "a new tensor instead of the buffer": (NewTensors, "in place"),
    "tables padded with -1": (PadsTablesWithMinusOne, "not -1"),
    "rows out of order": (RowsReversed, "row i is the step's i-th sequence"),
}, passes="the live engine")]
