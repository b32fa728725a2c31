"""Matplotlib figures and ipywidgets shared by the chapters (drawing only, no engine logic)."""

from __future__ import annotations

import sys

import ipywidgets
import matplotlib.pyplot as plt
import numpy as np

from minivllm.attention import causal_chunk_mask
from minivllm.config import cdiv

__all__ = ["plot_chunk_mask", "chunk_mask_widget", "PAGE_WIDTH"]

PAGE_WIDTH = 7.0  # inches: 672 px as SVG, the column's width at a 1280 px window (675 px); 7.5 pt shows as 10 px


def _for_the_page():
    """In a notebook, draw figures as SVG: sharp at any size, and scaled to the page's column as a whole.

    (Retina PNGs come with a fixed height that the page keeps when it narrows the image: they would be squashed.)
    A figure shows at its size, about 96 px per inch, scaled down to the column when wider: the figures here
    are at most about :data:`PAGE_WIDTH` wide, with several panels stacked rather than side by side, so that
    their labels stay readable on the page.
    """
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import select_figure_formats
        from matplotlib_inline.backend_inline import InlineBackend
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        backend = InlineBackend.instance(parent=shell)  # read again whenever the inline backend is set up
        backend.figure_formats = {"svg"}
        select_figure_formats(shell, {"svg"}, **backend.print_figure_kwargs)


_for_the_page()


def plot_chunk_mask(n: int, chunk_size: int, ax=None):
    """Draw the attention pattern of an ``n``-token prompt prefilled ``chunk_size`` tokens at a time (chapter 02).

    Row ``i`` is a query, column ``j`` a key. Each chunk's rows have their own
    colour: pale where the chunk reads keys cached by earlier chunks, solid where
    it attends causally within itself, white where the mask forbids. Stacked,
    the chunks' masks tile exactly the lower triangle of the dense causal mask.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(4.2, 4.2))
    colours = plt.get_cmap("tab10").colors
    image = np.ones((n, n, 3))
    for c, a in enumerate(range(0, n, chunk_size)):
        b = min(a + chunk_size, n)
        allowed = causal_chunk_mask(a, b).numpy()  # [b - a, b]
        colour = np.array(colours[c % len(colours)])
        for i in range(b - a):
            for j in np.flatnonzero(allowed[i]):
                image[a + i, j] = colour if j >= a else 1 - 0.4 * (1 - colour)
        if a > 0:
            ax.axhline(a - 0.5, color="black", linewidth=0.8)
    ax.imshow(image, interpolation="nearest")
    chunks = cdiv(n, chunk_size)
    ax.set_title(f"{n} tokens, chunk size {chunk_size}:\n{chunks} chunk{'s' * (chunks > 1)}", fontsize=9)
    ax.set_xlabel("key position j\n(pale: read from the cache)", fontsize=8)
    ax.set_ylabel("query position i", fontsize=8)
    ax.tick_params(labelsize=8)
    from matplotlib.ticker import MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):  # token positions: whole numbers
        axis.set_major_locator(MaxNLocator(integer=True))
    return ax


def _widgets():
    """``ipywidgets``, made drawable first on Colab (it draws ipywidgets 8 only through its custom widget manager)."""
    if "google.colab" in sys.modules:
        from google.colab import output  # exists only on Colab

        output.enable_custom_widget_manager()
    return ipywidgets


def chunk_mask_widget(n: int = 16, chunk_size: int = 4):
    """An ``IntSlider`` over the chunk size that redraws :func:`plot_chunk_mask` live (chapter 02).

    Needs a running kernel (Jupyter, Colab): a static page shows no widget.
    """
    widgets = _widgets()

    def draw(chunk_size):
        plot_chunk_mask(n, chunk_size)
        plt.show()

    slider = widgets.IntSlider(value=chunk_size, min=1, max=n, description="chunk size", continuous_update=False)
    return widgets.interactive(draw, chunk_size=slider)


def _owner_colours(seqs):
    colours = plt.get_cmap("tab10").colors
    return {s.request_id: colours[i % len(colours)] for i, s in enumerate(seqs)}


def plot_block_pool(block_manager, seqs, ncols: int = 8, axes=None):
    """Draw a paged KV pool: physical blocks coloured by owner, and each sequence's block table (chapter 04).

    Left, the pool as a grid of physical blocks: a block is coloured by the
    sequence that owns it (hatched when several share it), labelled
    ``request:logical block`` and shaded by how many of its slots hold tokens;
    free blocks are white. Right, each sequence's block table in token order:
    logical block ``j`` names the physical block that holds tokens
    ``[j * block_size, (j + 1) * block_size)``.
    """
    bm, bs = block_manager, block_manager.block_size
    colour = _owner_colours(seqs)
    owners: dict[int, list[tuple[str, int, int]]] = {}  # block -> [(request id, logical index, tokens held)]
    for s in seqs:
        for j, block in enumerate(s.block_table):
            owners.setdefault(block, []).append((s.request_id, j, min(bs, s.num_tokens - j * bs)))
    if axes is None:
        width = max(len(s.block_table) for s in seqs) if seqs else 1
        nrows = cdiv(bm.num_blocks, ncols)  # the pool above the tables, at the page's width
        _, axes = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 1.0 + 0.55 * nrows + 0.38 * max(len(seqs), 1)),
                               gridspec_kw={"height_ratios": [nrows + 0.6, 0.5 * max(len(seqs), 1) + 0.6]})
    ax_pool, ax_tables = axes
    nrows = cdiv(bm.num_blocks, ncols)
    for block in range(bm.num_blocks):
        r, c = divmod(block, ncols)
        y = nrows - 1 - r
        who = owners.get(block, [])
        ax_pool.add_patch(plt.Rectangle((c, y), 1, 1, facecolor="white", edgecolor="grey"))
        if who:
            rid, j, held = who[0]
            ax_pool.add_patch(plt.Rectangle((c, y), 1, held / bs, facecolor=colour[rid], alpha=0.85,
                                            hatch="//" if len(who) > 1 else None, edgecolor="grey"))
            label = f"{rid}:{j}" + (f" (x{len(who)})" if len(who) > 1 else "")
            ax_pool.text(c + 0.5, y + 0.62, label, ha="center", va="center", fontsize=8)
        ax_pool.text(c + 0.5, y + 0.2, str(block), ha="center", va="center", fontsize=7.5, color="#444444")
    ax_pool.set_xlim(0, ncols)
    ax_pool.set_ylim(0, nrows)
    ax_pool.axis("off")
    ax_pool.set_title(f"physical pool: {bm.num_blocks} blocks of {bs} slots, {bm.num_free_blocks} free", fontsize=10)
    for i, s in enumerate(seqs):
        y = len(seqs) - 1 - i
        for j, block in enumerate(s.block_table):
            held = min(bs, s.num_tokens - j * bs)
            ax_tables.add_patch(plt.Rectangle((j, y + 0.1), 1, 0.8, facecolor="white", edgecolor="grey"))
            ax_tables.add_patch(plt.Rectangle((j, y + 0.1), held / bs, 0.8, facecolor=colour[s.request_id],
                                              alpha=0.85, edgecolor="grey"))
            ax_tables.text(j + 0.5, y + 0.5, str(block), ha="center", va="center", fontsize=8)
        ax_tables.text(-0.15, y + 0.5, f"{s.request_id} ({s.num_tokens} tok)", ha="right", va="center", fontsize=8)
    width = max((len(s.block_table) for s in seqs), default=1)
    ax_tables.set_xlim(-2.2, max(width, ncols - 2.2))
    ax_tables.set_ylim(0, max(len(seqs), 1))
    ax_tables.axis("off")
    ax_tables.set_title("block tables (logical block -> physical block)", fontsize=10)
    return axes


__all__ += ["plot_block_pool"]


# Chapter 05 --------------------------------------------------------------------------------------

def plot_paged_step(block_tables, context_lens, slot_mapping, block_size: int, num_blocks: int, names,
                    ncols: int = 8, ax=None):
    """Draw one paged step in the pool, slot by slot (chapter 05).

    Every physical block is a column of ``block_size`` slots. A slot is
    coloured by the sequence whose block table names its block: pale for keys
    written in earlier steps, solid (labelled with the token's row in the flat
    batch) for the step's new tokens, written through ``slot_mapping``.
    """
    bs = block_size
    colours = plt.get_cmap("tab10").colors
    new_slot = {s: i for i, s in enumerate(list(slot_mapping))}
    owner = {table[pos // bs] * bs + pos % bs: b  # slot -> the sequence that holds it
             for b, (table, ctx) in enumerate(zip(block_tables, context_lens)) for pos in range(ctx)}
    nrows = cdiv(num_blocks, ncols)
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 0.9 * nrows * bs / 2 + 1.2))
        fig.subplots_adjust(left=0.01, right=0.99)
    for block in range(num_blocks):
        r, c = divmod(block, ncols)
        top = (nrows - r) * (bs + 1.5)
        ax.text(c + 0.5, top - 0.4, f"block {block}", ha="center", fontsize=8, color="dimgrey")
        for off in range(bs):
            slot, y = block * bs + off, top - 1.5 - off
            b = owner.get(slot)
            face = "white" if b is None else colours[b % len(colours)]
            ax.add_patch(plt.Rectangle((c + 0.05, y), 0.9, 0.9, facecolor=face, edgecolor="grey",
                                       alpha=1.0 if slot in new_slot else 0.3))
            if slot in new_slot:
                ax.text(c + 0.5, y + 0.45, str(new_slot[slot]), ha="center", va="center", fontsize=8, color="white")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[i % len(colours)]) for i in range(len(names))]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8, ncol=len(names),
              frameon=False)
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, nrows * (bs + 1.5))
    ax.axis("off")
    ax.set_title(f"the pool, {num_blocks} blocks of {bs} slots: pale = earlier steps' KV,\n"
                 "solid = this step's new tokens (their row in the flat batch)", fontsize=9)
    return ax


__all__ += ["plot_paged_step"]


# Chapter 06 --------------------------------------------------------------------------------------

__all__ += ["plot_batch_timeline"]

TIMELINE_KINDS = {  # kind -> (face colour, hatch, legend label)
    "prefill": ("#1f77b4", None, "prefill (prompt)"),
    "decode": ("#9ecae1", None, "decode (1 token)"),
    "wasted": ("#eeeeee", "///", "padding: row finished, still computed"),
}


def plot_batch_timeline(steps, request_ids=None, ax=None, title=None):
    """Which request ran in which engine step (chapter 06).

    ``steps[t]`` lists ``(request_id, kind)`` for the requests in step ``t``'s
    batch, ``kind`` one of ``"prefill"``, ``"decode"``, ``"wasted"``. One row per
    request, one column per step: a request joins the batch at its first
    coloured cell and leaves after its last.
    """
    if request_ids is None:
        request_ids = list(dict.fromkeys(rid for step in steps for rid, _ in step))
    row = {rid: i for i, rid in enumerate(request_ids)}
    if ax is None:
        _, ax = plt.subplots(figsize=(min(5.4, 2 + 0.22 * len(steps)), 0.8 + 0.32 * len(request_ids)))
    for t, step in enumerate(steps):
        for rid, kind in step:
            colour, hatch, _ = TIMELINE_KINDS[kind]
            ax.add_patch(plt.Rectangle((t, row[rid] - 0.4), 1, 0.8, facecolor=colour, hatch=hatch,
                                       edgecolor="white" if hatch is None else "#999999", linewidth=0.5))
    ax.set_xlim(0, max(len(steps), 1))
    ax.set_ylim(len(request_ids) - 0.5, -0.5)
    ax.set_yticks(range(len(request_ids)), [str(r) for r in request_ids])
    ax.set_xlabel("engine step (one forward of the model)")
    ax.set_ylabel("request")
    used = {kind for step in steps for _, kind in step}
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, hatch=h, edgecolor="#999999")
               for k, (c, h, _) in TIMELINE_KINDS.items() if k in used]
    ax.legend(handles, [lab for k, (_, _, lab) in TIMELINE_KINDS.items() if k in used],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax


# Chapter 08 --------------------------------------------------------------------------------------

__all__ += ["plot_hash_chain"]


def plot_hash_chain(prompts, block_size: int, hash_fn, names=None, ax=None, title=None):
    """The prefix cache's hash chain as a tree of blocks (chapter 08).

    Each full block of each prompt is a box with its tokens and the short form
    of its chain hash ``hash_fn(parent hash, tokens)``; an arrow runs from a
    block to the next one, whose hash it feeds. Prompts that start alike walk
    the same boxes (drawn once, shaded), and part ways where their tokens
    differ. A prompt's last, partial block has no hash: it is drawn dashed.
    """
    names = names or [f"prompt {i}" for i in range(len(prompts))]
    nodes: dict = {}  # chain hash -> (x, y, tokens, number of prompts through it)
    rows: list = []
    for row, tokens in enumerate(prompts):
        parent, path = None, []
        for i in range(len(tokens) // block_size):
            chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
            h = hash_fn(parent, chunk)
            x, y, t, n = nodes.get(h, (i, row, chunk, 0))
            nodes[h] = (x, y, t, n + 1)
            path.append(h)
            parent = h
        rows.append((path, tuple(tokens[len(tokens) // block_size * block_size:])))
    width = max(len(p) + (1 if tail else 0) for p, tail in rows)
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 1.1 * len(prompts) + 0.6))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.86)
    per_line = 4 if max((len(str(t)) for p in prompts for t in p), default=1) <= 2 else 2  # long ids: two a line
    tall = block_size > 2 * per_line
    bw, bh = 1.7, 0.9 if tall else 0.62

    def box(x, y, tokens, label, shared, dashed=False):
        ax.add_patch(plt.Rectangle((2.3 * x, -y - bh / 2), bw, bh, facecolor="#c6dbef" if shared else "white",
                                   edgecolor="grey" if dashed else "#08519c", linestyle="--" if dashed else "-",
                                   linewidth=1.2))
        lines = [" ".join(map(str, tokens[i:i + per_line])) for i in range(0, len(tokens), per_line)]
        ax.text(2.3 * x + bw / 2, -y + (0.13 if tall else 0.1), "\n".join(lines), ha="center", va="center",
                fontsize=7 if tall else 8)
        ax.text(2.3 * x + bw / 2, -y - (0.33 if tall else 0.18), label, ha="center", va="center", fontsize=7.5,
                color="dimgrey" if dashed else "#08519c", family="monospace")

    for h, (x, y, tokens, n) in nodes.items():
        box(x, y, tokens, f"#{h & 0xFFFF:04x}", n > 1)
    for row, (path, tail) in enumerate(rows):
        for a, b in zip(path, path[1:]):
            (xa, ya, *_), (xb, yb, *_) = nodes[a], nodes[b]
            ax.annotate("", xy=(2.3 * xb, -yb), xytext=(2.3 * xa + bw, -ya),
                        arrowprops=dict(arrowstyle="->", color="#08519c", lw=1))
        if tail:
            x = len(path)
            box(x, row, tail, "no hash", False, dashed=True)
            if path:
                xa, ya, *_ = nodes[path[-1]]
                ax.annotate("", xy=(2.3 * x, -row), xytext=(2.3 * xa + bw, -ya),
                            arrowprops=dict(arrowstyle="->", color="grey", lw=1, linestyle="--"))
        ax.text(-0.2, -row, names[row], ha="right", va="center", fontsize=9)
        if not tail and all(nodes[h][1] != row for h in path):
            ax.text(0, -row, f"all {len(path)} blocks drawn in the rows above (shared)", va="center", fontsize=8,
                    color="dimgrey", style="italic")
    ax.set_xlim(-2.2, 2.3 * width)
    ax.set_ylim(-len(prompts) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title(title or f"hash chain, block_size={block_size}: box = full block (tokens, #hash);\n"
                          "shaded = shared by several prompts, dashed = a partial block (no hash)", fontsize=9)
    return ax


# Chapter 09 --------------------------------------------------------------------------------------

__all__ += ["plot_prompt_chunks", "plot_step_timeline", "plot_stream_gaps", "plot_chunk_tradeoff", "choice_widget"]


def plot_prompt_chunks(prompt_len: int, cached: int, chunks, ax=None, title=None):
    """One prompt as a bar: the prefix served from the cache, then each prefill chunk ``(start, end)`` (chapter 09)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(PAGE_WIDTH, 1.3))
    if cached:
        ax.barh(0, cached, left=0, color="#bbbbbb", edgecolor="white")
        ax.text(cached / 2, 0, "from the\nprefix cache", ha="center", va="center", fontsize=8)
    colours = plt.get_cmap("tab10").colors
    for i, (a, b) in enumerate(chunks):
        ax.barh(0, b - a, left=a, color=colours[i % len(colours)], edgecolor="white", alpha=0.85)
        if (b - a) / prompt_len > 0.04:
            ax.text((a + b) / 2, 0, f"chunk\n{i}", ha="center", va="center", fontsize=8)
    edges = sorted({0, cached, prompt_len} | {x for c in chunks for x in c})
    ax.set_xticks(edges, [str(x) for x in edges], fontsize=8)
    ax.set_xlim(0, prompt_len)
    ax.set_yticks([])
    ax.set_xlabel("prompt position (chunk boundaries marked)")
    ax.set_title(title or f"{prompt_len}-token prompt: {cached} tokens from the prefix cache, "
                          f"{len(chunks)} prefill chunk{'s' * (len(chunks) != 1)}", fontsize=9)
    return ax


def plot_step_timeline(trace, ax=None, title=None, max_tokens=None):
    """Each engine step of a :class:`~minivllm.bench.ServingTrace` on the wall clock (chapter 09).

    A bar spans the step's duration; its height is the number of tokens the
    step computed, split into decode tokens (light) and prompt tokens (dark).
    A wide dark bar is a long prefill: every stream waits for it to end.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(PAGE_WIDTH, 2.6))
    t0 = trace.start
    for st in trace.steps:
        x, w = st.start - t0, st.seconds
        ax.bar(x, st.num_decodes, width=w, align="edge", color="#9ecae1", edgecolor="white", linewidth=0.3)
        ax.bar(x, st.prefill_tokens, width=w, bottom=st.num_decodes, align="edge", color="#08519c",
               edgecolor="white", linewidth=0.3)
    ax.set_xlim(0, trace.seconds)
    if max_tokens:
        ax.set_ylim(0, max_tokens)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("tokens in the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#08519c", "#9ecae1")]
    ax.legend(handles, ["prompt tokens", "decode tokens"], loc="upper right", fontsize=8, frameon=False)
    ax.set_title(title or trace.label, fontsize=10)
    return ax


def plot_stream_gaps(trace, request_ids, ax=None, title=None, max_gap=None, label=None, color=None):
    """The streams' inter-token gaps against the time each token appeared (chapter 09).

    One dot per output token after the first: its height is how long the user
    waited for it since the previous token of the same request.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(PAGE_WIDTH, 2.6))
    t0 = trace.start
    xs, ys = [], []
    for rid in request_ids:
        times = trace.metrics[rid].token_times
        xs += [b - t0 for b in times[1:]]
        ys += [b - a for a, b in zip(times, times[1:])]
    ax.scatter(xs, ys, s=10, color=color or "#d62728", label=label)
    arrival = trace.metrics.get("long")
    if arrival is not None:
        ax.axvline(arrival.arrival_time - t0, color="grey", linestyle="--", linewidth=1)
        ax.text(arrival.arrival_time - t0, ax.get_ylim()[1] if max_gap is None else max_gap, " long prompt arrives",
                fontsize=8, va="top", color="dimgrey")
    ax.set_xlim(0, trace.seconds)
    ax.set_ylim(0, max_gap or None)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("gap before token (s)")
    ax.set_title(title or f"{trace.label}: inter-token gaps of the streams", fontsize=10)
    return ax


def plot_chunk_tradeoff(summaries: dict, selected=None, axes=None):
    """Worst stream gap, long-prompt TTFT and throughput for each chunk-size setting (chapter 09).

    ``summaries`` maps a setting's label to :func:`~minivllm.bench.interference_summary`;
    the ``selected`` label is drawn dark.
    """
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(PAGE_WIDTH, 2.8))
        plt.subplots_adjust(wspace=0.6)
    labels = list(summaries)
    colours = ["#08519c" if lab == selected else "#9ecae1" for lab in labels]
    panels = [("max_gap", "longest gap of a stream (s)", "lower is better"),
              ("long_ttft", "long prompt's TTFT (s)", "lower is better"),
              ("throughput", "output tokens / s", "higher is better")]
    for ax, (key, ylabel, better) in zip(axes, panels):
        ax.bar(range(len(labels)), [summaries[lab][key] for lab in labels], color=colours)
        ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_title(better, fontsize=9)
    return axes


def choice_widget(options, draw, description: str = "setting", value=None):
    """A ``Dropdown`` over ``options`` that calls ``draw(option)`` on every change (chapter 09).

    Needs a running kernel (Jupyter, Colab): a static page shows no widget.
    """
    widgets = _widgets()
    options = list(options)
    dropdown = widgets.Dropdown(options=options, value=options[0] if value is None else value,
                                description=description)
    return widgets.interactive(draw, option=dropdown)
# -- end of the chapters 08-09 section --


# Chapter 10 --------------------------------------------------------------------------------------

__all__ += ["plot_preemption_comparison"]

TIMELINE_KINDS.setdefault("recompute", ("#d62728", None, "prefill again after preemption (recompute)"))
TIMELINE_KINDS.setdefault("preempted", ("#ffffff", "xx", "preempted in this step"))


def plot_preemption_comparison(rows: dict, axes=None):
    """Chapter 10's bar charts: completion time, mean TTFT, mean TPOT and preemptions per setting."""
    names = list(rows)
    panels = [("completion_s", "completion time (s)", 1), ("mean_ttft_s", "mean TTFT (s)", 1),
              ("mean_tpot_s", "mean TPOT (ms)", 1e3), ("preemptions", "preemptions", 1)]
    if axes is None:
        _, axes = plt.subplots(2, 2, figsize=(PAGE_WIDTH, 5.2))
        axes = axes.ravel()
    colours = ["#7f7f7f", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    for ax, (key, label, scale) in zip(axes, panels):
        ax.bar(names, [rows[n][key] * scale for n in names], color=colours[:len(names)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30)
    plt.tight_layout()
    return axes


def _box(ax, xy, text, color="#dce9f5", width=2.6, height=0.8, fontsize=8):
    x, y = xy
    ax.add_patch(plt.Rectangle((x - width / 2, y - height / 2), width, height, facecolor=color, edgecolor="#333333",
                               linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, text=None, rad=0.0, color="#333333", text_dy=0.18, text_dx=0.0, ha="center",
           fontsize=7):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1,
                                                          connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2 + text_dx, (start[1] + end[1]) / 2 + text_dy, text, ha=ha,
                va="center", fontsize=fontsize, color=color)


def plot_engine_loop(ax=None):
    """One engine step as a loop: schedule, copy blocks, forward, sample, update, detokenize (chapters 00, 06)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.3))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    stages = [((1.3, 2.5), "LLM.generate /\nadd_request: validate,\nqueue a Sequence", "#f5e6d3"),
              ((4.6, 2.5), "Scheduler.schedule()\ndecodes, prefills,\nadmissions; blocks\nfrom the BlockManager",
               "#dce9f5"),
              ((7.9, 2.5), "ModelRunner\nblock copies,\none forward, sample\nthe last rows", "#dff0d8"),
              ((7.9, 0.45), "Scheduler.update()\nappend tokens, stop,\nfree, register\ncached blocks", "#dce9f5"),
              ((4.6, 0.45), "detokenize,\nstop strings,\nRequestOutput\n(deltas)", "#f5e6d3")]
    for xy, text, color in stages:
        _box(ax, xy, text, color, width=2.4, height=1.25, fontsize=8)
    _arrow(ax, (2.5, 2.5), (3.4, 2.5))
    _arrow(ax, (5.8, 2.5), (6.7, 2.5), "Scheduler-\nOutput", text_dy=0.3, fontsize=7.5)
    _arrow(ax, (7.9, 1.875), (7.9, 1.075), "sampled ids", text_dy=0.0, text_dx=0.1, ha="left", fontsize=7.5)
    _arrow(ax, (6.7, 0.45), (5.8, 0.45))
    _arrow(ax, (4.6, 1.075), (4.6, 1.875), "next step", color="#777777", text_dy=0.0, text_dx=0.1, ha="left",
           fontsize=7.5)
    ax.plot([3.4, 1.3], [0.45, 0.45], color="#777777", lw=1)  # the deltas go back to the caller
    _arrow(ax, (1.3, 0.45), (1.3, 1.875), "stream to\nthe caller", color="#777777", text_dy=-0.25, text_dx=-0.1,
           ha="right", fontsize=7.5)
    ax.set_xlim(0, 9.2)
    ax.set_ylim(-0.25, 3.2)
    ax.axis("off")
    ax.set_title("one engine step (LLMEngine.step): every request moves through it together", fontsize=9)
    return ax


def plot_state_machine(ax=None):
    """A Sequence's states and the transitions between them (chapters 06, 09, 10)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.4))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    pos = {"WAITING": (1.0, 2.3), "PREFILLING": (3.8, 2.3), "RUNNING": (6.6, 2.3), "FINISHED_*": (9.5, 2.3),
           "SWAPPED": (5.2, 0.3)}
    colors = {"WAITING": "#f5e6d3", "PREFILLING": "#dce9f5", "RUNNING": "#dff0d8", "FINISHED_*": "#e6e6e6",
              "SWAPPED": "#f2dede"}
    for name, xy in pos.items():
        _box(ax, xy, name, colors[name], width=1.7, height=0.6, fontsize=8)
    fs = 7.5
    _arrow(ax, (1.85, 2.3), (2.95, 2.3), "admitted", text_dy=0.2, fontsize=fs)
    _arrow(ax, (4.65, 2.3), (5.75, 2.3), "prompt\ncomputed", text_dy=0.3, fontsize=fs)
    _arrow(ax, (7.45, 2.3), (8.65, 2.3), "stop /\nlength", text_dy=0.3, fontsize=fs)
    _arrow(ax, (3.4, 2.6), (4.2, 2.6), "chunk after chunk (chunked prefill)", rad=-1.2, color="#555555",
           text_dy=0.72, fontsize=fs)
    _arrow(ax, (6.6, 2.0), (1.0, 2.0), rad=-0.3, color="#aa3333")
    ax.text(2.3, 0.95, "preempted: recompute\n(its KV dropped)", ha="center", va="center", fontsize=fs,
            color="#aa3333")
    _arrow(ax, (6.3, 2.0), (5.6, 0.6), "preempted:\nswap", color="#aa3333", text_dy=-0.35, text_dx=0.2, ha="left",
           fontsize=fs)
    _arrow(ax, (4.8, 0.6), (4.1, 2.0), "swapped in", color="#aa3333", text_dy=-0.55, text_dx=-0.1, ha="right",
           fontsize=fs)
    ax.text(9.5, 1.4, "any state -> ABORTED\n(abort_request) or\nERROR (the request\nfailed)", ha="center",
            va="center", fontsize=fs, color="#555555")
    ax.set_xlim(0, 10.6)
    ax.set_ylim(-0.1, 3.45)
    ax.axis("off")
    ax.set_title("a Sequence's life: its status after each engine step", fontsize=9)
    return ax


def plot_request_life(outputs, ax=None, title=None):
    """Each request's life from its own timestamps: waiting, prefill, each token, finish (chapter 00)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(PAGE_WIDTH, 0.9 + 0.45 * len(outputs)))
    t0 = min(o.metrics.arrival_time for o in outputs)
    for row, out in enumerate(outputs):
        m = out.metrics
        arrival, scheduled, first = (x - t0 for x in (m.arrival_time, m.first_scheduled_time, m.first_token_time))
        ax.barh(row, scheduled - arrival, left=arrival, color="#f5e6d3", edgecolor="#999999")
        ax.barh(row, first - scheduled, left=scheduled, color="#1f77b4")
        ax.barh(row, m.finish_time - m.first_token_time, left=first, color="#2ca02c", alpha=0.35)
        ax.plot([t - t0 for t in m.token_times], [row] * len(m.token_times), "|", color="#2ca02c", markersize=9)
    ax.set_yticks(range(len(outputs)), [o.request_id for o in outputs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first request arrived")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#f5e6d3", "#1f77b4", "#2ca02c")]
    ax.legend(handles, ["waiting", "prefill (until the first token: TTFT)", "decode, one tick per token"],
              fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    ax.set_title(title or "each request's life, from its own timestamps", fontsize=9, pad=20)
    return ax


# Chapter 05: a PagedBatch's groups -----------------------------------------------------------------

__all__ += ["plot_paged_batch"]


def _grid(ax, values, x0, y0, face, label=None, hatch=None):
    """One row of cells at (x0, y0), each with its value written in; ``face``/``hatch`` are per cell."""
    for i, v in enumerate(values):
        ax.add_patch(plt.Rectangle((x0 + i, y0), 0.95, 0.9, facecolor=face[i], edgecolor="grey", linewidth=0.6,
                                   hatch=None if hatch is None else hatch[i]))
        ax.text(x0 + i + 0.47, y0 + 0.45, str(v), ha="center", va="center", fontsize=8)
    if label:
        ax.text(x0 - 0.3, y0 + 0.45, label, ha="right", va="center", fontsize=8)


def plot_paged_batch(batch, query_lens, names, axes=None):
    """A ``PagedBatch`` as pictures: the flat tokens, then per group its padded block tables,
    ``query_index`` rows and mask (chapter 05).

    Top: the step's tokens in the flat order the model sees them, coloured by
    sequence. Then, for each group (decodes apart from prefills), one row per
    sequence: its padded block table (hatched: padding, never read), its
    ``query_index`` (the flat rows it gathers; hatched: padding rows, whose
    outputs ``out_index`` drops), and below it the group's mask, query rows
    against key slots (dark: may attend). ``axes``: the top one, then each
    group's two.
    """
    from matplotlib.ticker import MaxNLocator

    colours = plt.get_cmap("tab10").colors
    owner = [b for b, q in enumerate(query_lens) for _ in range(q)]
    groups = list(batch.groups)
    width = max([len(owner)] + [max(g.block_tables.shape[1], g.query_index.shape[1]) for g in groups])
    if axes is None:  # one column, at the page's width: the flat tokens, then each group's tables above its mask
        heights = [0.5]
        for group in groups:
            rows, queries = group.block_tables.shape[0], group.mask.shape[0] * group.mask.shape[1]
            heights += [0.45 + 0.42 * rows, 0.9 + min(0.12 * queries, 1.2)]
        fig = plt.figure(figsize=(PAGE_WIDTH, sum(heights) + 0.25 * len(heights)), layout="constrained")
        grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
        axes = [fig.add_subplot(grid[k, 0]) for k in range(len(heights))]
    top = axes[0]
    _grid(top, range(len(owner)), 0, 0, [colours[b % 10] for b in owner], "flat token rows")
    top.set_xlim(-4.2, width + 0.2)
    top.set_ylim(-0.2, 1.1)
    top.axis("off")
    top.set_title("one step's PagedBatch: the flat tokens, then each group as padded rectangles", fontsize=9)
    start = [sum(query_lens[:b]) for b in range(len(query_lens))]
    for g, group in enumerate(groups):
        left, right = axes[1 + 2 * g], axes[2 + 2 * g]
        tables, qidx, valid = group.block_tables.tolist(), group.query_index.tolist(), group.valid.tolist()
        mask = group.mask.cpu()
        bs = mask.shape[-1] // max(len(tables[0]), 1)
        for row, (table, q, ok) in enumerate(zip(tables, qidx, valid)):
            b = owner[q[0]] if ok[0] else owner[start.index(q[0])] if q[0] in start else 0
            used = [bool(mask[row, :, j * bs:(j + 1) * bs].any()) for j in range(len(table))]
            y = 2 * (len(tables) - 1 - row)
            c = colours[b % 10]
            _grid(left, table, 0, y + 1, [c if u else "white" for u in used], f"{names[b]}: block table",
                  [None if u else "///" for u in used])
            _grid(left, q, 0, y, [c if v else "white" for v in ok], "query_index", [None if v else "///" for v in ok])
        left.set_xlim(-4.2, width + 0.2)
        left.set_ylim(-0.3, 2 * len(tables) + 0.1)
        left.axis("off")
        kind = "decodes" if mask.shape[1] == 1 else "prefills and chunks"
        left.set_title(f"group {g} ({kind}): {len(tables)} rows, tables padded to {len(tables[0])} blocks",
                       fontsize=9)
        right.imshow(mask.reshape(-1, mask.shape[-1]).numpy(), cmap="Greys", aspect="auto", interpolation="nearest")
        for row in range(1, len(tables)):
            right.axhline(row * mask.shape[1] - 0.5, color=colours[3], linewidth=1)
        right.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole rows and key slots, never 0.5
        right.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(6, mask.shape[0] * mask.shape[1])))
        right.set_xlabel("key slot of the padded row (block j holds keys j*block_size ...)", fontsize=8)
        right.set_ylabel("query rows", fontsize=8)
        right.set_title(f"group {g} mask {tuple(mask.shape)}: dark = may attend", fontsize=9)
        right.tick_params(labelsize=8)
    if axes[0].figure.get_layout_engine() is None:
        plt.tight_layout()
    return axes


# Chapter 13: the server's threads and queues --------------------------------------------------------

__all__ += ["plot_serving_paths"]


def plot_serving_paths(ax=None):
    """The event loop, the engine's loop thread and the per-request queues, with one request's path (chapter 13)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 4.0))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93)
    red, fs = "#c0392b", 7.5
    ax.add_patch(plt.Rectangle((0.1, 0.05), 4.6, 3.75, facecolor="#f7f7f7", edgecolor="#999999", linestyle="--"))
    ax.text(2.4, 3.62, "event loop thread (uvicorn + FastAPI)", ha="center", va="center", fontsize=8,
            color="#555555")
    ax.add_patch(plt.Rectangle((5.3, 0.05), 5.4, 3.75, facecolor="#f7f7f7", edgecolor="#999999", linestyle="--"))
    ax.text(8.0, 3.62, "engine loop thread (EngineLoop.turn)", ha="center", va="center", fontsize=8,
            color="#555555")
    for k, y in enumerate((2.6, 1.8, 1.0)):
        _box(ax, (1.2, y), f"handler,\nrequest {k}", "#f5e6d3" if k else "#fbd3a5", width=1.6, height=0.6,
             fontsize=fs)
        _box(ax, (3.55, y), f"asyncio.Queue {k}", "#dff0d8" if k else "#b9e0a5", width=1.9, height=0.6, fontsize=fs)
        _arrow(ax, (2.6, y), (2.0, y), None, color="#2c7a2c")
    _box(ax, (6.2, 2.6), "inbox\n(new,\naborts)", "#dce9f5", width=1.2, height=0.85, fontsize=fs)
    _box(ax, (8.45, 2.6), "LLMEngine.step()\nschedule, forward,\nsample, detokenize", "#dce9f5", width=2.5,
         height=0.85, fontsize=fs)
    _box(ax, (8.45, 1.15), "route: each output\nto its request's queue", "#dce9f5", width=2.5, height=0.7,
         fontsize=fs)
    _arrow(ax, (6.8, 2.6), (7.2, 2.6))
    _arrow(ax, (8.45, 2.175), (8.45, 1.5))
    _arrow(ax, (9.7, 1.15), (9.7, 2.175), "next\nstep", color="#888888", rad=0.6, text_dy=0.0, text_dx=0.52,
           ha="left", fontsize=fs)
    # one request's path, numbered
    ax.plot([1.2, 1.2, 6.2], [2.9, 3.15, 3.15], color=red, lw=1)
    _arrow(ax, (6.2, 3.15), (6.2, 3.025), color=red)
    ax.text(3.7, 3.2, "1 add_request: validate, put in the inbox", ha="center", va="bottom", fontsize=fs,
            color=red)
    ax.text(8.45, 3.2, "2 the request joins the batch", ha="center", va="bottom", fontsize=fs, color=red)
    _arrow(ax, (7.2, 0.95), (4.5, 2.45), color=red)
    ax.text(8.0, 0.4, "3 call_soon_threadsafe(\nqueue.put_nowait, output)", ha="center", va="center", fontsize=fs,
            color=red)
    ax.text(2.4, 0.4, "4 the handler awaits its queue, sends each\ndelta as an SSE chunk; if the client "
            "leaves,\nit aborts the request", ha="center", va="center", fontsize=fs, color=red)
    ax.set_xlim(0, 10.8)
    ax.set_ylim(0, 3.85)
    ax.axis("off")
    ax.set_title("AsyncLLM: the engine never runs on the event loop; each request reads only its own queue",
                 fontsize=9)
    return ax


__all__ += ["step_overlap", "plot_engine_processes"]


def step_overlap(before: float, device: float, after: float, steps: int = 3, overlap: bool = False):
    """When each phase of ``steps`` engine steps runs, on one host thread and one device: ``before`` (schedule,
    prepare), ``device`` (the forward), ``after`` (update, detokenize). Synchronous, step k+1 starts after
    step k's ``after``; with ``overlap`` (asynchronous scheduling) the host prepares step k+1 as soon as it has
    launched step k, and finishes step k once its forward is done. Returns ``{"host": [(start, length, label)],
    "device": [...], "period": seconds between two steps once running}`` (chapter 13)."""
    host, dev = _overlap_run(before, device, after, steps, overlap)
    ends = [s + n for s, n, _ in _overlap_run(before, device, after, 40, overlap)[1]]
    return {"host": host, "device": dev, "period": ends[-1] - ends[-2]}


def _overlap_run(before, device, after, steps, overlap):
    host, dev, done = [], [], []
    host_free = dev_free = 0.0
    order = [("b", 0)] + [x for k in range(steps)
                          for x in ((("b", k + 1), ("a", k)) if overlap else (("a", k), ("b", k + 1)))]
    for kind, k in order:
        if kind == "a":
            start = max(host_free, done[k])
            host.append((start, after, f"update {k}"))
            host_free = start + after
        elif k < steps:
            host.append((host_free, before, f"schedule {k}"))
            host_free += before
            start = max(dev_free, host_free)
            dev.append((start, device, f"forward {k}"))
            dev_free = start + device
            done.append(dev_free)
    return host, dev


def plot_engine_processes(before: float, device: float, after: float, axes=None):
    """vLLM V1's two processes against minivllm's one (left), and a step's phases, measured, run synchronously
    and with asynchronous scheduling (right): ``before`` schedule and prepare, ``device`` the forward and the
    logits, ``after`` update and detokenize, in seconds (chapter 13)."""
    if axes is None:
        fig, axes = plt.subplots(2, 1, figsize=(PAGE_WIDTH, 7.6), gridspec_kw={"height_ratios": [1.25, 1]})
        fig.subplots_adjust(left=0.09, right=0.99, bottom=0.07, top=0.96, hspace=0.22)
    ax = axes[0]
    for x, w, y, h, label in ((0.1, 4.5, 3.0, 3.0, "vLLM V1: API server process"),
                              (5.5, 4.6, 3.0, 3.0, "vLLM V1: EngineCore process"),
                              (0.1, 10.0, 0.05, 2.65, "minivllm: one process (AsyncLLM), one GIL")):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor="#f7f7f7", edgecolor="#999999", linestyle="--"))
        ax.text(x + w / 2, y + h - 0.3, label, ha="center", fontsize=8, color="#555555")
    fs = 7.5
    _box(ax, (2.35, 4.85), "uvicorn event loop: HTTP, JSON,\ntokenize (input processor)", "#f5e6d3",
         width=3.9, height=0.75, fontsize=fs)
    _box(ax, (2.35, 3.8), "AsyncLLM: OutputProcessor\ndetokenize, a queue per request", "#f5e6d3", width=3.9,
         height=0.75, fontsize=fs)
    _box(ax, (7.8, 4.95), "input thread: ZMQ -> input_queue", "#dce9f5", width=4.2, height=0.5, fontsize=fs)
    _box(ax, (7.8, 4.25), "run_busy_loop: schedule, execute,\nupdate (a GIL of its own)", "#dce9f5", width=4.2,
         height=0.7, fontsize=fs)
    _box(ax, (7.8, 3.45), "output thread: output_queue -> ZMQ", "#dce9f5", width=4.2, height=0.5, fontsize=fs)
    _arrow(ax, (4.3, 4.85), (5.7, 4.95))
    _arrow(ax, (5.7, 3.45), (4.3, 3.7))
    ax.text(5.05, 4.3, "ZMQ,\nmsgpack", ha="center", va="center", fontsize=fs)
    _box(ax, (2.6, 1.25), "event loop thread: HTTP, JSON,\ntokenize, each request's handler", "#f5e6d3",
         width=4.2, height=0.9, fontsize=fs)
    _box(ax, (7.6, 1.25), "engine loop thread: inbox, LLMEngine.step\n(schedule, forward, sample, update,\n"
         "detokenize), route to the queues", "#dce9f5", width=4.6, height=1.1, fontsize=fs)
    _arrow(ax, (4.7, 1.45), (5.4, 1.45))
    _arrow(ax, (5.4, 1.0), (4.7, 1.0))
    ax.text(5.05, 0.3, "Python runs on one of the two threads at a time", ha="center", fontsize=fs,
            color="#c0392b")
    ax.set_xlim(0, 10.2)
    ax.set_ylim(0, 6.0)
    ax.axis("off")
    ax.set_title("where the engine loop runs", fontsize=9)

    ax = axes[1]
    colours = {"schedule": "#9ecae1", "update": "#fdae6b", "forward": "#74c476"}
    span = 3 * (before + device + after)
    for row, overlap in ((1.5, False), (0.0, True)):
        lanes = step_overlap(before, device, after, overlap=overlap)
        for lane, dy in (("host", 0.2), ("device", -0.2)):
            for start, length, label in lanes[lane]:
                kind = label.split()[0]
                ax.barh(row + dy, 1e3 * length, left=1e3 * start, height=0.3, color=colours[kind],
                        edgecolor="#333333", linewidth=0.5)
                if length > 0.03 * span:  # the step's number, where it fits
                    ax.text(1e3 * (start + length / 2), row + dy, label.split()[1], ha="center",
                            va="center", fontsize=8)
        ax.text(0, row + 0.48, ("asynchronous scheduling" if overlap else "synchronous") +
                f": a step every {1e3 * lanes['period']:.1f} ms once running", fontsize=8)
    ax.set_yticks([0.2, -0.2, 1.7, 1.3], ["host", "device", "host", "device"], fontsize=8)
    ax.set_ylim(-1.0, 2.2)
    ax.set_xlabel("ms (measured phases, three steps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, ["schedule, prepare", "update, detokenize", "forward, logits"], fontsize=8,
              loc="lower center", ncol=3)  # one row, under the bars
    ax.set_title("what asynchronous scheduling overlaps (on a GPU)", fontsize=9)
    return axes


# Chapter 14: the device pool, the tier and one step's copies ---------------------------------------

__all__ += ["plot_offload_step"]


def plot_offload_step(offload, restore, num_blocks: int, num_tier_blocks: int, ax=None, title=None):
    """One step's copies between the device pool and the host tier, in the order the runner makes them (chapter 14).

    ``offload`` lists (device block, tier slot) pairs, ``restore`` (tier slot,
    device block) pairs, as in ``SchedulerOutput``. Offloads go first (1), since
    their device blocks are someone's new blocks in this very step; then the
    restores (2); then the forward (3) reads and writes the pool.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.3))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    dev_x = {b: 0.5 + b * (10.0 / max(num_blocks, 1)) for b in range(num_blocks)}
    tier_x = {s: 0.5 + s * (10.0 / max(num_tier_blocks, 1)) for s in range(num_tier_blocks)}
    dw, tw = 9.0 / max(num_blocks, 1), 9.0 / max(num_tier_blocks, 1)
    out_dev, out_tier = {d for d, _ in offload}, {t for _, t in offload}
    in_dev, in_tier = {d for _, d in restore}, {t for t, _ in restore}
    for b, x in dev_x.items():
        face = "#f4a582" if b in out_dev else "#92c5de" if b in in_dev else "#eeeeee"
        ax.add_patch(plt.Rectangle((x, 2.4), dw, 0.6, facecolor=face, edgecolor="grey"))
        ax.text(x + dw / 2, 2.7, str(b), ha="center", va="center", fontsize=8 if num_blocks <= 16 else 7)
    for s, x in tier_x.items():
        face = "#f4a582" if s in out_tier else "#92c5de" if s in in_tier else "#eeeeee"
        ax.add_patch(plt.Rectangle((x, 0.4), tw, 0.6, facecolor=face, edgecolor="grey"))
        ax.text(x + tw / 2, 0.7, str(s), ha="center", va="center", fontsize=8 if num_tier_blocks <= 16 else 7.5)
    ax.text(0.4, 2.7, "device pool\n(blocks)", ha="right", va="center", fontsize=8.5)
    ax.text(0.4, 0.7, "host tier\n(slots)", ha="right", va="center", fontsize=8.5)
    for d, t in offload:
        _arrow(ax, (dev_x[d] + dw / 2, 2.4), (tier_x[t] + tw / 2, 1.0), color="#b2182b")
    for t, d in restore:
        _arrow(ax, (tier_x[t] + tw / 2, 1.0), (dev_x[d] + dw / 2, 2.4), color="#2166ac")
    ax.text(-1.3, -0.05, f"1 offloads ({len(offload)}): evicted blocks'\nKV out, before anything writes them",
            fontsize=8, color="#b2182b", va="center")
    ax.text(3.6, -0.05, f"2 restores ({len(restore)}): tier hits\nback into fresh device blocks", fontsize=8,
            color="#2166ac", va="center")
    ax.text(7.6, -0.05, "3 the forward: reads\nand writes the pool", fontsize=8, va="center")
    ax.set_xlim(-1.4, 10.6)
    ax.set_ylim(-0.4, 3.1)
    ax.axis("off")
    ax.set_title(title or "one step's copies between the device pool and the tier", fontsize=9)
    return ax


# Chapter 15: column- and row-parallel linears --------------------------------------------------------

__all__ += ["plot_tp_split"]


def _matrix(ax, x, y, w, h, parts=1, axis=None, colours=None, label=None, alpha=1.0):
    """A matrix as a rectangle, cut into ``parts`` slices along columns (``axis=1``) or rows (``axis=0``)."""
    for p in range(parts):
        if axis == 1:
            box = (x + p * w / parts, y, w / parts, h)
        elif axis == 0:
            box = (x, y + h - (p + 1) * h / parts, w, h / parts)
        else:
            box = (x, y, w, h)
        face = "#dddddd" if colours is None else colours[p % len(colours)]
        ax.add_patch(plt.Rectangle(box[:2], *box[2:], facecolor=face, edgecolor="#333333", linewidth=0.8,
                                   alpha=alpha))
    if label:
        ax.text(x + w / 2, y - 0.15, label, ha="center", va="top", fontsize=7.5)


def plot_tp_split(tp: int = 3, ax=None):
    """``X -> column-parallel W1 -> H -> row-parallel W2 -> partial Y per rank -> all-reduce -> Y`` (chapter 15).

    Colours are ranks. Rank ``r`` holds the ``r``-th column slice of ``W1^T``
    (so it computes the ``r``-th slice of ``H``, no communication) and the
    ``r``-th row slice of ``W2^T`` (which multiplies exactly that slice of
    ``H``); its product is a full-width partial ``Y``, and the all-reduce sums
    the ``tp`` partials.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.2))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    colours = plt.get_cmap("tab10").colors[:tp]
    _matrix(ax, 0.2, 1.2, 0.8, 1.6, label="X\n[tokens, K]\nevery rank")
    ax.text(1.25, 2.0, "@", fontsize=12, ha="center", va="center")
    _matrix(ax, 1.5, 0.9, 1.6, 2.2, tp, 1, colours, "W1^T [K, N]\ncolumn-parallel:\nrank r holds N/tp columns")
    ax.text(3.35, 2.0, "=", fontsize=12, ha="center", va="center")
    _matrix(ax, 3.6, 1.2, 1.6, 1.6, tp, 1, colours, "H [tokens, N]\nrank r has its slice\n(no communication)")
    ax.text(5.45, 2.0, "@", fontsize=12, ha="center", va="center")
    _matrix(ax, 5.7, 0.9, 1.2, 2.2, tp, 0, colours, "W2^T [N, K]\nrow-parallel:\nrank r holds N/tp rows")
    ax.text(7.15, 2.0, "=", fontsize=12, ha="center", va="center")
    for r in range(tp):
        _matrix(ax, 7.4 + 0.18 * r, 1.5 - 0.18 * r, 0.8, 1.6, colours=[colours[r]], alpha=0.85)
    ax.text(7.95, 0.75, f"{tp} partial Y,\none per rank,\nfull width", ha="center", va="top", fontsize=7.5)
    _arrow(ax, (8.75, 2.0), (9.35, 2.0), "all-reduce\n(sum)", text_dy=0.35, fontsize=7.5)
    _matrix(ax, 9.5, 1.2, 0.8, 1.6, label="Y [tokens, K]\non every rank")
    ax.set_xlim(-0.2, 10.6)
    ax.set_ylim(-0.1, 3.3)
    ax.axis("off")
    ax.set_title(f"column then row over {tp} ranks (colour = rank): one all-reduce for the pair", fontsize=9)
    return ax


# Chapter 17: a verified decode row on the block table -------------------------------------------------

__all__ += ["SPEC_KINDS", "spec_frame", "plot_spec_rollback"]

SPEC_KINDS = {  # what a slot holds, drawn in this colour, with this legend
    "computed": ("#92c5de", "KV of a token of the sequence"),
    "last": ("#fdb863", "the last token: its KV is computed in this step"),
    "draft": ("#f4a582", "a draft: verified in this step (its KV written)"),
    "accepted": ("#4dac26", "an accepted draft: its KV is the sequence's"),
    "bonus": ("#ffffbf", "the bonus token: the sequence's, its KV next step"),
    "rejected": ("#d7191c", "a rejected draft's stale KV: rewritten next step"),
    "empty": ("#ffffff", "an empty slot"),
}


def spec_frame(seq, block_manager, label: str, marks: dict | None = None, released=()) -> dict:
    """One moment of a sequence's block table for :func:`plot_spec_rollback`: every slot's kind (``marks``, position
    -> kind of :data:`SPEC_KINDS`, else "computed" below ``seq.cached_token_count`` and "empty" above), the blocks
    registered in the prefix cache, and ``released`` blocks (gone back to the pool)."""
    bs, marks = block_manager.block_size, marks or {}
    kinds = [marks.get(p, "computed" if p < seq.cached_token_count else "empty")
             for p in range(len(seq.block_table) * bs)]
    registered = {i for i, b in enumerate(seq.block_table) if block_manager.blocks[b].hash is not None}
    return {"label": label, "blocks": list(seq.block_table), "kinds": kinds, "registered": registered,
            "released": list(released)}


def plot_spec_rollback(frames, block_size: int, ax=None, title=None):
    """A verified decode row step by step (chapter 17): one row per frame (:func:`spec_frame`), each block of the
    sequence a box of ``block_size`` slots coloured by what they hold, a bold edge for a block in the prefix cache,
    and the released blocks, hatched, on the right."""
    width = max(len(f["blocks"]) + len(f["released"]) for f in frames) * (block_size + 1) + 1
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(PAGE_WIDTH, 1.2 + 0.32 * width), 1.6 + 1.1 * len(frames)))
        fig.subplots_adjust(left=0.2, right=0.99)
    for r, frame in enumerate(frames):
        y = 1.25 * (len(frames) - 1 - r)
        ax.text(-0.4, y + 0.35, frame["label"], ha="right", va="center", fontsize=8.5)
        for i, block in enumerate(frame["blocks"]):
            x0 = i * (block_size + 1)
            for s in range(block_size):
                kind = frame["kinds"][i * block_size + s]
                ax.add_patch(plt.Rectangle((x0 + s, y), 1, 0.7, facecolor=SPEC_KINDS[kind][0], edgecolor="grey"))
            cached = i in frame["registered"]
            ax.add_patch(plt.Rectangle((x0, y), block_size, 0.7, fill=False, edgecolor="black",
                                       linewidth=2.2 if cached else 0.8))
            ax.text(x0 + block_size / 2, y + 0.82, f"block {block}" + (" (cached)" if cached else ""),
                    ha="center", fontsize=8)
        for j, block in enumerate(frame["released"]):
            x0 = (len(frame["blocks"]) + j) * (block_size + 1)
            ax.add_patch(plt.Rectangle((x0, y), block_size, 0.7, facecolor="#eeeeee", edgecolor="grey",
                                       hatch="//"))
            ax.text(x0 + block_size / 2, y + 0.82, f"block {block}: back to the pool", ha="center", fontsize=7.5)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="grey") for c, _ in SPEC_KINDS.values()]
    ax.legend(handles, [t for _, t in SPEC_KINDS.values()], loc="upper left", bbox_to_anchor=(0.0, 0.0), fontsize=8,
              ncol=2, frameon=False)
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-0.2, 1.25 * len(frames))
    ax.axis("off")
    ax.set_title(title or "one verified decode row on the block table", fontsize=9)
    return ax


# Chapter 18: one row of paged attention, and a Q4_1 block ---------------------------------------------------------

__all__ += ["plot_paged_row", "plot_q4_1_block"]


def plot_paged_row(block_table, length: int, block_size: int, num_blocks: int, positions, heads=(9, 3), ax=None,
                   title=None, labels=None):
    """What a paged-attention kernel reads for one sequence (chapter 18).

    Bottom: the pool, ``num_blocks`` blocks of ``block_size`` slots; the
    sequence's blocks are numbered by their place in its ``block_table``. Above
    it, one line per query row at ``positions`` (a decode row sits at
    ``length - 1``; a prefill chunk's rows at their own positions): its keys
    in logical order, block by block, coloured where the row reads them
    (keys ``0 .. position``), hatched where it must not (after its position,
    and the slots past ``length``), with an arrow from each logical block to
    the pool's block that holds it (``labels`` name the rows). Under the pool: the
    grouped-query heads, ``heads = (query heads, KV heads)``, query head ``h``
    reading KV head ``h // group``.
    """
    colours = plt.get_cmap("tab10").colors
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 3.0 + 0.3 * len(positions)))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.94)
    slot_w = 1.0
    gap = 0.6
    pool_y = 0.0
    owner = {b: i for i, b in enumerate(block_table)}
    for b in range(num_blocks):  # the pool
        x0 = b * (block_size * slot_w + gap)
        for s in range(block_size):
            mine = b in owner and owner[b] * block_size + s < length
            face = colours[0] if mine else ("#d0d0d0" if b not in owner else "white")
            ax.add_patch(plt.Rectangle((x0 + s * slot_w, pool_y), slot_w * 0.95, 0.8, facecolor=face,
                                       edgecolor="grey", linewidth=0.5, alpha=0.85 if mine else 1.0))
        ax.text(x0 + block_size * slot_w / 2, pool_y - 0.25, f"block {b}" + (f"\n(table[{owner[b]}])"
                if b in owner else ""), ha="center", va="top", fontsize=7.5)
    ax.text(-0.5, pool_y + 0.4, "the pool", ha="right", va="center", fontsize=8)
    row_w = len(block_table) * (block_size * slot_w + gap)
    x_rows = max(0.0, (num_blocks * (block_size * slot_w + gap) - row_w) / 2)
    for r, pos in enumerate(positions):  # the rows, logical keys
        y = 2.6 + 1.0 * (len(positions) - 1 - r)
        for i in range(len(block_table)):
            x0 = x_rows + i * (block_size * slot_w + gap)
            for s in range(block_size):
                key = i * block_size + s
                seen = key <= pos
                ax.add_patch(plt.Rectangle((x0 + s * slot_w, y), slot_w * 0.95, 0.7,
                                           facecolor=colours[1] if seen else "white", edgecolor="grey",
                                           linewidth=0.5, hatch=None if seen else "///"))
        label = labels[r] if labels else f"row at position {pos}"
        ax.text(x_rows - 0.5, y + 0.35, label, ha="right", va="center", fontsize=8)
    top = 2.6 + 1.0 * (len(positions) - 1) + 0.85
    for i, b in enumerate(block_table):  # logical block i -> the pool's block table[i]
        start = (x_rows + i * (block_size * slot_w + gap) + block_size * slot_w / 2, 2.55)
        end = (b * (block_size * slot_w + gap) + block_size * slot_w / 2, pool_y + 0.85)
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=colours[0], lw=1.0))
        ax.text(start[0], top, f"{i * block_size}..{i * block_size + block_size - 1}", ha="center", fontsize=7.5)
    ax.text(x_rows - 0.5, top, "keys", ha="right", fontsize=8)
    width = max(num_blocks * (block_size * slot_w + gap), x_rows + row_w)
    h, kvh = heads  # grouped-query heads, under the pool: query head q reads KV head q // group
    group = h // kvh
    hw = min(3.0, (width - 1.0) / h)
    qy, ky = -2.9, -4.5
    for q in range(h):
        ax.add_patch(plt.Rectangle((q * hw, qy), hw * 0.85, 0.6, facecolor=colours[2 + q // group],
                                   edgecolor="grey", linewidth=0.5))
        ax.text(q * hw + hw * 0.425, qy + 0.3, f"q{q}", ha="center", va="center", fontsize=7.5)
    for g in range(kvh):
        xk = (g * group + (group - 1) / 2) * hw
        ax.add_patch(plt.Rectangle((xk, ky), hw * 0.85, 0.6, facecolor=colours[2 + g], edgecolor="black",
                                   linewidth=0.8))
        ax.text(xk + hw * 0.425, ky + 0.3, f"kv{g}", ha="center", va="center", fontsize=7.5)
        for q in range(g * group, (g + 1) * group):
            ax.annotate("", xy=(xk + hw * 0.425, ky + 0.6), xytext=(q * hw + hw * 0.425, qy),
                        arrowprops=dict(arrowstyle="-", color="grey", lw=0.6))
    ax.text(h * hw + 0.5, (qy + ky + 0.6) / 2, f"{h} query heads, {kvh} KV heads", va="center", fontsize=8)
    ax.set_xlim(-9.0, width + 0.2)
    ax.set_ylim(ky - 0.2, top + 0.6)
    ax.axis("off")
    ax.set_title(title or f"one sequence of {length} tokens in blocks of {block_size}: what each row reads",
                 fontsize=9)
    return ax


def plot_q4_1_block(block: bytes, ax=None, title=None):
    """One GGUF Q4_1 block, byte by byte, and the 32 weights it holds (chapter 18).

    Top: its 20 bytes, the fp16 scale ``d`` (bytes 0-1), the fp16 minimum
    ``m`` (2-3), then 16 bytes of quants, each in hex, eight to a row. Under
    each row of quants: the weights of their low nibbles (weight ``j`` for
    quant byte ``j``) and of their high nibbles (weight ``j + 16``), each
    with its quant and its value ``d * q + m``; a line joins byte ``j`` to
    weights ``j`` and ``j + 16``.
    """
    import struct

    block = bytes(block)
    if len(block) != 20:
        raise ValueError(f"a Q4_1 block is 20 bytes, got {len(block)}")
    d, m = struct.unpack("<ee", block[:4])
    if ax is None:
        fig, ax = plt.subplots(figsize=(PAGE_WIDTH, 5.4))
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.94)
    header = ["#fdb863"] * 2 + ["#b2abd2"] * 2
    for i, byte in enumerate(block[:4]):  # d and m
        x = 2.0 + i * 1.1 + (0.4 if i >= 2 else 0.0)
        ax.add_patch(plt.Rectangle((x, 8.6), 1.0, 0.7, facecolor=header[i], edgecolor="grey"))
        ax.text(x + 0.5, 8.95, f"{byte:02x}", ha="center", va="center", fontsize=8, family="monospace")
    ax.text(3.05, 9.4, f"d (fp16)\n{d:.6g}", ha="center", fontsize=8)
    ax.text(5.65, 9.4, f"m (fp16)\n{m:.6g}", ha="center", fontsize=8)
    ax.text(8.0, 9.2, "bytes 0-3, then 16 bytes of quants:\nweight j in the low nibble of quant j,\n"
            "weight j + 16 in its high nibble", ha="left", va="center", fontsize=8)
    for half_row, top in ((0, 7.5), (1, 3.7)):  # quants 0-7, then 8-15
        ax.text(1.9, top + 0.35, "quant bytes", ha="right", va="center", fontsize=8)
        ax.text(1.9, top - 1.05, "low nibbles", ha="right", va="center", fontsize=8)
        ax.text(1.9, top - 2.35, "high nibbles", ha="right", va="center", fontsize=8)
        for c in range(8):
            j = 8 * half_row + c
            byte, x = block[4 + j], 2.0 + c * 1.55
            ax.add_patch(plt.Rectangle((x, top), 1.45, 0.7, facecolor="#92c5de", edgecolor="grey"))
            ax.text(x + 0.72, top + 0.35, f"{byte:02x}", ha="center", va="center", fontsize=8, family="monospace")
            for half, y in ((0, top - 1.55), (1, top - 2.85)):
                q = byte & 0x0F if half == 0 else byte >> 4
                ax.add_patch(plt.Rectangle((x, y), 1.45, 1.0, facecolor="#e7f0e7" if half == 0 else "#f4e3e3",
                                           edgecolor="grey"))
                ax.text(x + 0.72, y + 0.7, f"w{j + 16 * half}: q={q}", ha="center", va="center", fontsize=7.5)
                ax.text(x + 0.72, y + 0.3, f"{d * q + m:.4g}", ha="center", va="center", fontsize=7.5)
            ax.plot([x + 0.72, x + 0.72], [top, top - 0.55], color="grey", lw=0.6)
    ax.set_xlim(-0.2, 14.5)
    ax.set_ylim(0.6, 10.2)
    ax.axis("off")
    ax.set_title(title or "one Q4_1 block: 20 bytes for 32 weights, weight = d * q + m", fontsize=9)
    return ax
