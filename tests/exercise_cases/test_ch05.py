"""Chapter 05: a reader's paged attention backend (a PagedKVCache subclass's forward)."""

import torch
import torch.nn.functional as F

from minivllm.attention import PagedKVCache
from minivllm.exercises import check_paged_attention

from exercise_cases import Check


class MyPagedKVCache(PagedKVCache):
    """The solution notebook's answer."""

    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        k_pool, v_pool = self.k[layer], self.v[layer]
        k_pool.view(-1, kv_heads, d)[batch.slot_mapping] = k
        v_pool.view(-1, kv_heads, d)[batch.slot_mapping] = v
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


class ByHandSoftmax(PagedKVCache):
    """Another right answer: slots gathered with the flat view, an explicit softmax, GQA by reshaping the queries."""

    def forward(self, layer, q, k, v, positions, batch):
        kv_heads, d = k.shape[1:]
        flat_k, flat_v = self.k[layer].view(-1, kv_heads, d), self.v[layer].view(-1, kv_heads, d)
        flat_k.index_copy_(0, batch.slot_mapping, k)
        flat_v.index_copy_(0, batch.slot_mapping, v)
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


class WritesLayerZero(MyPagedKVCache):
    def forward(self, layer, q, k, v, positions, batch):
        return super().forward(0, q, k, v, positions, batch)


CHECKS = [Check("05", check_paged_attention, [MyPagedKVCache, ByHandSoftmax, PagedKVCache], {
    "reads before writing": (_variant(read_first=True), "read before"),
    "mask ignored": (_variant(mask=lambda m: torch.ones_like(m)), "mask was ignored"),
    "mask flipped": (_variant(mask=lambda m: ~m), "flipped"),
    "wrong KV head (h % kv_heads)": (_variant(tiled=True), r"not h % kv_heads"),
    "padding rows kept": (_variant(keep_padding=True), "padding rows"),
    "never writes the pool": (_variant(write=False), "read before|slot_mapping"),
    "ignores the layer": (WritesLayerZero, "layer"),
}, passes="the live engine")]
