"""Chapter 05: a reader's paged attention backend (a PagedKVCache subclass's forward)."""

import torch
import torch.nn.functional as F

from minivllm.attention import MiniPagedKVCache, PagedKVCache
from minivllm.cuda_graphs import MiniDecodeGraphRunner
from minivllm.exercises import check_paged_attention
from minivllm.model_runner import StepInputs

from exercise_cases import Check


class MyPagedKVCache(PagedKVCache):
    """The solution notebook's answer."""

    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        self.k_slots[layer][batch.slot_mapping] = k
        self.v_slots[layer][batch.slot_mapping] = v
        k_pool, v_pool = self.k[layer], self.v[layer]
        group = q.shape[1] // kv_heads
        out = torch.empty_like(q)
        for g in batch.groups:
            B, W = g.block_tables.shape
            keys = k_pool[g.block_tables].view(B, W * self.block_size, kv_heads, d)
            values = v_pool[g.block_tables].view(B, W * self.block_size, kv_heads, d)
            keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)
            values = values.repeat_interleave(group, dim=2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[g.query_index].transpose(1, 2), keys, values, attn_mask=g.mask[:, None])
            out[g.out_index] = o.transpose(1, 2)[g.valid]
        return out

    forward.skips_padding_slots = True


class ByHandSoftmax(PagedKVCache):
    """Another right answer: slots gathered with the flat view, an explicit softmax, GQA by reshaping the queries."""

    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        self.k_slots[layer][batch.slot_mapping] = k  # slot -1 (a padding row): the scratch slot
        self.v_slots[layer][batch.slot_mapping] = v
        flat_k, flat_v = self.k[layer].view(-1, kv_heads, d), self.v[layer].view(-1, kv_heads, d)
        heads, group, bs = q.shape[1], q.shape[1] // kv_heads, self.block_size
        out = torch.zeros_like(q)
        for g in batch.groups:
            B, W = g.block_tables.shape
            key_slots = (g.block_tables[:, :, None] * bs + torch.arange(bs)).flatten(1)  # [B, S]
            keys, values = flat_k[key_slots], flat_v[key_slots]  # [B, S, kvh, d]
            queries = q[g.query_index].view(B, -1, kv_heads, group, d)  # [B, Lq, kvh, group, d]
            scores = torch.einsum("bqhgd,bshd->bhgqs", queries, keys) / d ** 0.5
            scores = scores.masked_fill(~g.mask[:, None, None], float("-inf"))
            o = torch.einsum("bhgqs,bshd->bqhgd", scores.softmax(-1), values).reshape(B, -1, heads, d)
            for b in range(B):
                rows = g.valid[b]
                out[g.query_index[b][rows]] = o[b][rows]
        return out


def _variant(read_first=False, mask=lambda m: m, tiled=False, keep_padding=False, write=True):
    """The solution's forward with one characteristic mistake."""
    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        k_pool, v_pool = self.k[layer], self.v[layer]
        group = q.shape[1] // kv_heads
        out = torch.empty_like(q)

        def attend_groups():
            for g in batch.groups:
                B, W = g.block_tables.shape
                keys = k_pool[g.block_tables].view(B, W * self.block_size, kv_heads, d)
                values = v_pool[g.block_tables].view(B, W * self.block_size, kv_heads, d)
                expand = (lambda x: x.repeat(1, 1, group, 1)) if tiled else (
                    lambda x: x.repeat_interleave(group, dim=2))
                o = F.scaled_dot_product_attention(q[g.query_index].transpose(1, 2), expand(keys).transpose(1, 2),
                                                   expand(values).transpose(1, 2), attn_mask=mask(g.mask)[:, None])
                o = o.transpose(1, 2)
                if keep_padding:
                    out[g.query_index.flatten()] = o.flatten(0, 1)
                else:
                    out[g.out_index] = o[g.valid]

        if read_first:
            attend_groups()
        if write:
            k_pool.view(-1, kv_heads, d)[batch.slot_mapping] = k
            v_pool.view(-1, kv_heads, d)[batch.slot_mapping] = v
        if not read_first:
            attend_groups()
        return out
    return type("WrongPagedKVCache", (PagedKVCache,), {"forward": forward})


class IndexCopiesIntoThePoolView(MyPagedKVCache):
    """Writes with index_copy_ through the pool's flat view: fine for real slots, an error for slot -1."""

    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        self.k[layer].view(-1, kv_heads, d).index_copy_(0, batch.slot_mapping, k)
        self.v[layer].view(-1, kv_heads, d).index_copy_(0, batch.slot_mapping, v)
        return _variant(write=False).forward(self, layer, q, k, v, positions, batch)


class WritesLayerZero(MyPagedKVCache):
    def forward(self, layer, q, k, v, positions, batch):
        return super().forward(0, q, k, v, positions, batch)


CHECKS = [Check("05", check_paged_attention, [MyPagedKVCache, ByHandSoftmax], {
    "reads before writing": (_variant(read_first=True), "read before"),
    "mask ignored": (_variant(mask=lambda m: torch.ones_like(m)), "mask was ignored"),
    "decode groups without their mask": (_variant(mask=lambda m: torch.ones_like(m) if m.shape[1] == 1 else m),
                                         "a decode group .* without its mask"),
    "mask flipped": (_variant(mask=lambda m: ~m), "flipped"),
    "wrong KV head (h % kv_heads)": (_variant(tiled=True), r"not h % kv_heads"),
    "padding rows kept": (_variant(keep_padding=True), "padding rows"),
    "never writes the pool": (_variant(write=False), "read before|slot_mapping"),
    "ignores the layer": (WritesLayerZero, "layer"),
    "writes through self.k[layer].view(-1, ...) (slot -1 is a real slot there)": (_variant(), "a padding row wrote"),
    "index_copy_ into the pool view (slot -1 is out of range)": (IndexCopiesIntoThePoolView, "on slot -1"),
}, passes="the live engine")]


def test_padding_rows_of_a_replayed_decode_step_write_no_real_slot(tiny):
    """The solution's write pattern under chapter 12's padded decode (the CUDA graph runner's eager replay on the CPU).

    Three decodes run as a graph of size 4: the padding row has slot -1. Only the three real slots may change in
    the pools' real blocks (a write through ``self.k[layer].view(-1, ...)`` would put the padding row's key in the
    last real slot), and the real rows' hidden states equal minivllm's own backend's.
    """
    model, _ = tiny
    hidden = {}
    for cls in (MyPagedKVCache, MiniPagedKVCache):
        cache = cls.for_model(model, 16, 4)
        g = torch.Generator().manual_seed(0)
        cache.k_slots.copy_(torch.randn(cache.k_slots.shape, generator=g))  # every slot holds some earlier key
        cache.v_slots.copy_(torch.randn(cache.v_slots.shape, generator=g))
        before = cache.k.clone(), cache.v.clone()
        graphs = MiniDecodeGraphRunner(model, cache, 4, 4, 64, model.config.num_attention_heads //
                                       model.config.num_key_value_heads, capture=False)
        step = StepInputs([7, 8, 9], [5, 6, 2], [21, 26, 34], [[1, 5], [3, 6], [8]], [6, 7, 3], [1, 1, 1],
                          [0, 1, 2])
        assert graphs.load(step) == 4 and graphs.slot_mapping[3].item() == -1  # one padding row
        hidden[cls] = graphs.run(step)
        for pool, old in zip((cache.k, cache.v), before):
            changed = (pool != old).flatten(3).any(-1).flatten(1, 2).any(0).nonzero().flatten().tolist()
            assert changed == [21, 26, 34], f"{cls.__name__} wrote the real slots {changed}"
    assert torch.allclose(hidden[MyPagedKVCache], hidden[MiniPagedKVCache], atol=1e-5)
