"""The chapters' drawing functions draw what they are given (chapters 05, 13, 14, 15, 17, 18): light checks of their artists."""

import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from minivllm.attention import PagedBatch  # noqa: E402
from minivllm.viz import plot_offload_step, plot_paged_batch, plot_serving_paths, plot_tp_split  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _arrows(ax):
    return [t for t in ax.texts if isinstance(t, Annotation) and t.arrow_patch is not None]


def _rectangles(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_offload_step_draws_every_block_slot_and_copy():
    offload, restore = [(3, 5), (4, 6), (9, 0)], [(1, 7)]
    ax = plot_offload_step(offload, restore, num_blocks=12, num_tier_blocks=24)
    assert len(_rectangles(ax)) == 12 + 24
    assert len(_arrows(ax)) == len(offload) + len(restore)
    shown = " ".join(t.get_text() for t in ax.texts)
    assert "1 offloads (3)" in shown and "2 restores (1)" in shown


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_split_draws_one_slice_per_rank_and_one_all_reduce(tp):
    ax = plot_tp_split(tp)
    assert len(_rectangles(ax)) == 1 + tp + tp + tp + tp + 1  # X, W1 slices, H slices, W2 slices, partials, Y
    (reduce,) = _arrows(ax)
    assert "all-reduce" in " ".join(t.get_text() for t in ax.texts)


def test_serving_paths_names_the_queues_and_numbers_one_request_path():
    ax = plot_serving_paths()
    shown = [t.get_text() for t in ax.texts]
    assert sum(s.startswith("asyncio.Queue") for s in shown) == 3
    assert [s[0] for s in shown if s[:1].isdigit()] == ["1", "2", "3", "4"]


def test_paged_batch_draws_the_flat_tokens_and_each_group():
    query_lens, context_lens, bs = [1, 1, 7, 5], [9, 17, 7, 13], 4
    tables, free = [], iter(range(16))
    for c in context_lens:
        tables.append([next(free) for _ in range(math.ceil(c / bs))])
    batch = PagedBatch(tables, context_lens, query_lens, bs, torch.device("cpu"), 3)
    axes = plot_paged_batch(batch, query_lens, ["A", "B", "C", "D"])
    assert len(axes) == 1 + 2 * len(batch.groups)
    assert len(_rectangles(axes[0])) == batch.num_tokens
    for g, group in enumerate(batch.groups):
        left, right = axes[1 + 2 * g], axes[2 + 2 * g]
        rows, width = group.block_tables.shape
        assert len(_rectangles(left)) == rows * (width + group.query_index.shape[1])
        hatched = [p for p in _rectangles(left) if p.get_hatch()]
        padding = (~group.valid).sum().item() + sum(
            not group.mask[r, :, j * bs:(j + 1) * bs].any() for r in range(rows) for j in range(width))
        assert len(hatched) == padding
        (image,) = right.get_images()
        assert image.get_array().shape == (rows * group.mask.shape[1], group.mask.shape[2])


def test_spec_rollback_draws_each_slot_the_cached_blocks_and_the_released_ones():
    from minivllm.sampling_params import SamplingParams
    from minivllm.scheduler import SchedulerOutput
    from minivllm.sequence import Sequence
    from minivllm.simulator import make_scheduler
    from minivllm.viz import plot_spec_rollback, spec_frame

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 2}
    sched = make_scheduler(8, block_size=4, enable_prefix_caching=True, speculative_config=spec)
    bm, seq = sched.block_manager, Sequence("r", list(range(10, 16)), SamplingParams(temperature=0.0, max_tokens=9))
    sched.add(seq)
    sched.update(sched.schedule(), [40])
    assert bm.allocate(seq, 7 + 4)
    out = SchedulerOutput()
    out.add(sched.chunk(seq, 1, [50, 51, 52, 53]))
    before = spec_frame(seq, bm, "scheduled", {6: "last", **{p: "draft" for p in range(7, 11)}})
    table = list(seq.block_table)
    sched.update(out, [60], None, [1])  # one draft accepted: block 2 held only rejected drafts
    after = spec_frame(seq, bm, "rolled back", {7: "accepted", 8: "bonus"}, released=table[2:])
    assert before["kinds"] == ["computed"] * 6 + ["last"] + ["draft"] * 4 + ["empty"]
    assert after["kinds"] == ["computed"] * 7 + ["accepted"] and after["registered"] == {0, 1}
    assert after["released"] == [table[2]] and table[2] in bm.free_blocks
    ax = plot_spec_rollback([before, after], block_size=4)
    thick = [p for p in _rectangles(ax) if not p.get_fill() and p.get_linewidth() > 2]
    hatched = [p for p in _rectangles(ax) if p.get_hatch()]
    assert len(thick) == 1 + 2 and len(hatched) == 1  # block 0 cached before, blocks 0 and 1 after; the released one
    assert len([p for p in _rectangles(ax) if p.get_fill() and not p.get_hatch()]) == 12 + 8
    shown = " ".join(t.get_text() for t in ax.texts)
    assert f"block {table[2]}: back to the pool" in shown and "(cached)" in shown


def test_paged_row_draws_the_pool_each_rows_keys_and_one_arrow_per_block():
    from minivllm.viz import plot_paged_row

    table, length, bs, pool, positions = [5, 1, 3], 10, 4, 7, [9, 6, 8]
    ax = plot_paged_row(table, length, bs, pool, positions, heads=(6, 2))
    rects = _rectangles(ax)
    assert len(rects) == pool * bs + len(positions) * len(table) * bs + 6 + 2  # slots, row keys, heads
    hatched = [p for p in rects if p.get_hatch()]
    assert len(hatched) == sum(len(table) * bs - (p + 1) for p in positions)  # keys after each row's position
    assert len(_arrows(ax)) == len(table) + 6  # one per logical block, one per query head
    shown = " ".join(t.get_text() for t in ax.texts)
    assert "(table[0])" in shown and "(table[2])" in shown and "6 query heads, 2 KV heads" in shown


def test_q4_1_block_draws_its_bytes_and_32_weights_as_d_q_plus_m():
    import struct

    from minivllm.viz import plot_q4_1_block

    quants = list(range(16)) + [15 - j // 2 for j in range(16)]
    block = struct.pack("<ee", 0.5, -2.5) + bytes(quants[j] | quants[j + 16] << 4 for j in range(16))
    ax = plot_q4_1_block(block)
    assert len(_rectangles(ax)) == 20 + 32
    shown = [t.get_text() for t in ax.texts]
    assert "d (fp16)\n0.5" in shown and "m (fp16)\n-2.5" in shown
    for j, q in enumerate(quants):
        assert f"w{j}: q={q}" in shown and f"{0.5 * q - 2.5:.4g}" in shown
    with pytest.raises(ValueError, match="20 bytes"):
        plot_q4_1_block(block[:19])


@pytest.mark.parametrize("before, device, after", [(2.0, 10.0, 3.0), (4.0, 2.0, 3.0), (3.0, 5.0, 3.0)])
def test_step_overlap_keeps_each_lane_serial_and_each_step_in_order(before, device, after):
    """The model behind chapter 13's figure: one host thread, one device; a step's forward after its schedule,
    its update after its forward; asynchronous scheduling runs a step every max(forward, host work)."""
    from minivllm.viz import step_overlap

    for overlap, period in ((False, before + device + after), (True, max(device, before + after))):
        run = step_overlap(before, device, after, steps=6, overlap=overlap)
        assert math.isclose(run["period"], period)
        for lane in ("host", "device"):
            spans = sorted(run[lane])
            assert all(a[0] + a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:])), lane
        start = {label: s for s, _, label in run["host"] + run["device"]}
        end = {label: s + n for s, n, label in run["host"] + run["device"]}
        for k in range(6):
            assert end[f"schedule {k}"] <= start[f"forward {k}"] and end[f"forward {k}"] <= start[f"update {k}"]
            if not overlap and k:  # synchronous: nothing of step k before step k - 1 is done
                assert end[f"update {k - 1}"] <= start[f"schedule {k}"]


def test_engine_processes_draws_both_architectures_and_both_timelines():
    from minivllm.viz import plot_engine_processes

    left, right = plot_engine_processes(0.004, 0.02, 0.006)
    shown = " ".join(t.get_text() for t in left.texts)
    assert "EngineCore process" in shown and "one GIL" in shown and "run_busy_loop" in shown
    labels = " ".join(t.get_text() for t in right.texts)
    assert "a step every 30.0 ms" in labels and "a step every 20.0 ms" in labels
    assert len(right.patches) >= 2 * (3 * 3)  # three steps, three phases each, in both timelines
