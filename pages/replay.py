"""Allocator replay: what the CUDA caching allocator does with one traced step, drawn inline (like
pytorch.org/memory_viz): allocated vs reserved over the step's events, and the segments at the reserved peak.

The stream comes from tracing a preset on fake CPU tensors (small sizes; bench.trace.streams.trace_stream) or from an
uploaded .npz (python -m bench trace --stream / measure --stream-dir), which offline.allocator.Stream.load
validates as untrusted input (no pickle). The replay is offline.allocator.replay; this page only draws it.
"""
from __future__ import annotations

import io

import altair as alt
import pandas as pd
import streamlit as st

from estimator.alloc_conf import parse_alloc_conf
from offline.allocator.replay import replay, segments_at
from offline.allocator.stream import Stream
from estimator.presets import load_config
from estimator.spec import Parallel, Workload
from estimator.units import GiB, MiB, fmt_bytes
from pages import _charts as charts
from pages import _state as state, _inputs as ui
from bench.trace.streams import trace_stream

PAGE = "replay"
KINDS = {"train": "Training step (full fine-tune, AdamW)", "lora": "LoRA training step",
         "infer": "Inference (prefill + decode)"}
MAX_POINTS = 1500              # timeline points sent to the browser (each the max over its events)
MAX_UPLOAD_BYTES = 64 * MiB
NPZ_KEY = f"{PAGE}:npz"        # the current stream's .npz bytes (session state)


def fields() -> dict[str, state.Field]:
    return {
        "model": ui.model_field(),
        "kind": state.Field("kind", "choice", "train", tuple(KINDS), label="Workload",
                         help="What to trace: two training steps (the second is the steady state) or generation."),
        "batch": state.Field("batch", "int", 1, lo=1, hi=8, label="Batch", help="Small sizes: tracing runs here."),
        "seq": state.Field("seq", "int", 128, lo=8, hi=1024, label="Sequence length",
                        help="Tokens per sequence (the prompt, for inference; 8 tokens are then generated)."),
        "alloc": ui.alloc_conf_field(),
    }


def workload(kind: str, batch: int, seq: int) -> Workload:
    if kind == "infer":
        return Workload(mode="infer", precision="bf16", batch=batch, seq=seq, gen_tokens=8)
    return Workload(mode="train", method="lora" if kind == "lora" else "full", recipe="pure", precision="bf16",
                    batch=batch, seq=seq)


def to_npz(stream: Stream) -> bytes:
    buf = io.BytesIO()
    stream.save(buf)
    return buf.getvalue()


def trace_section(f: dict) -> None:
    name = state.widget(PAGE, f["model"], st.sidebar)
    kind = state.widget(PAGE, f["kind"], st.sidebar, format_func=KINDS.get)
    batch = state.widget(PAGE, f["batch"], st.sidebar)
    seq = state.widget(PAGE, f["seq"], st.sidebar)
    if st.sidebar.button("Trace this step", key=f"{PAGE}:trace", type="primary"):

        _, config = load_config(name)
        bar = st.progress(0.0, text=f"Tracing {name} on fake CPU tensors (no GPU, no weights)")
        _, stream = trace_stream(config, name, workload(kind, batch, seq), Parallel())
        bar.progress(1.0, text=f"Traced: {len(stream):,} allocator events")
        st.session_state[NPZ_KEY] = to_npz(stream)
    up = st.sidebar.file_uploader("or load a stream (.npz)", type=["npz"], key=f"{PAGE}:upload",
                                  help="From python -m bench trace --stream FILE or measure --stream-dir; "
                                       f"at most {MAX_UPLOAD_BYTES // MiB} MiB, validated, never unpickled.")
    if up is not None:
        if up.size > MAX_UPLOAD_BYTES:
            st.error(f"{up.name} is {up.size:,} bytes; a stream file here is at most {MAX_UPLOAD_BYTES:,} bytes.")
            return
        data = up.getvalue()
        Stream.load(io.BytesIO(data))          # a bad file: one ValueError line, shown by run_page
        st.session_state[NPZ_KEY] = data


def timeline_chart(result, stream: Stream) -> alt.Chart:
    """Allocated and reserved (GiB) after each event, downsampled to MAX_POINTS maxima; stages as bands."""
    tl = result.timeline(MAX_POINTS)
    names = [stream.stage_names[s] for s in stream.stage[tl.event].tolist()]
    df = pd.concat([pd.DataFrame({"event": tl.event, "GiB": tl.allocated / GiB, "series": "allocated",
                                  "stage": names}),
                    pd.DataFrame({"event": tl.event, "GiB": tl.reserved / GiB, "series": "reserved",
                                  "stage": names})])
    return alt.Chart(df).mark_line(interpolate="step-after").encode(
        x=alt.X("event:Q", title="Allocator event (allocation or free, in order)"),
        y=alt.Y("GiB:Q", title="GiB (2^30 bytes)"),
        color=alt.Color("series:N", scale=alt.Scale(range=charts.SERIES_COLORS[:2]), title=None),
        tooltip=["event:Q", "series:N", "stage:N", alt.Tooltip("GiB:Q", format=".3f")]).properties(height=320)


def segments_chart(segments) -> alt.Chart:
    """One bar per segment (largest first), split into its blocks: allocated or cached free."""
    rows = []
    for i, seg in enumerate(sorted(segments, key=lambda s: -s.total_size)[:60]):
        offset = 0
        for b in seg.blocks:
            rows.append({"segment": i, "start MiB": offset / MiB, "end MiB": (offset + b.size) / MiB,
                         "state": "allocated" if b.state == "active_allocated" else "free (cached)",
                         "pool": seg.segment_type, "MiB": b.size / MiB})
            offset += b.size
    df = pd.DataFrame(rows)
    return alt.Chart(df).mark_bar().encode(
        y=alt.Y("segment:O", title="Segment (largest first)"), x=alt.X("start MiB:Q", title="MiB (2^20 bytes)"),
        x2="end MiB:Q", color=alt.Color("state:N", scale=alt.Scale(range=["#4c78a8", "#e45756"]), title=None),
        tooltip=["segment:O", "pool:N", "state:N", alt.Tooltip("MiB:Q", format=",.2f")]
    ).properties(height=max(120, 14 * df["segment"].nunique()) if len(df) else 120)


def replay_section(data: bytes, alloc: str) -> None:
    stream = Stream.load(io.BytesIO(data))
    cfg = parse_alloc_conf(alloc)
    result = replay(stream, cfg)
    o = result.overall
    m = stream.meta
    st.caption(f"{len(stream):,} events from {m.get('source', '?')} {m.get('model', '')}; allocator "
               f"{alloc or 'defaults'}.")
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Peak allocated", fmt_bytes(o.peak_allocated_bytes), help="torch.cuda.max_memory_allocated()")
    c2.metric("Peak reserved", fmt_bytes(o.peak_reserved_bytes), help="torch.cuda.max_memory_reserved(): the "
              "segments the allocator holds. The CUDA context comes on top.")
    c3.metric("Fragmentation at the peak", fmt_bytes(o.fragmentation_at_peak_bytes),
              help="reserved - allocated when reserved last grew: cached blocks and split tails.")
    c4.metric("Largest free block then", fmt_bytes(o.largest_free_at_peak_bytes))
    charts.show(timeline_chart(result, stream))
    st.dataframe(pd.DataFrame([{"stage": s.name, "allocated (GiB)": s.peak_allocated_bytes / GiB,
                                "reserved (GiB)": s.peak_reserved_bytes / GiB,
                                "cudaMalloc calls": s.device_allocs} for s in result.stages if s.events]),
                 hide_index=True, column_config={c: st.column_config.NumberColumn(format="%.3f")
                                                 for c in ("allocated (GiB)", "reserved (GiB)")})
    peak_event = int(result.reserved.argmax()) + 1 if len(result.reserved) else 0
    segs = segments_at(stream, peak_event, cfg)
    st.subheader(f"Segments at the reserved peak ({len(segs)})")
    if segs:
        charts.show(segments_chart(segs))
    st.download_button("Download the stream (.npz)", data, file_name="allocation-stream.npz",
                       mime="application/octet-stream", key=f"{PAGE}:download")


def main() -> None:
    f = fields()
    state.init_state(PAGE, list(f.values()))
    st.title("Allocator replay")
    st.caption("A traced step replayed through the model of PyTorch's CUDA caching allocator: what "
               "memory_allocated and memory_reserved would show, event by event. Sizes in GiB (2^30 bytes).")
    shown = {"model", "kind", "batch", "seq", "alloc"}
    try:
        trace_section(f)
        alloc = ui.alloc_conf_input(PAGE, f["alloc"], st.sidebar)
    finally:
        state.write_url(PAGE, list(f.values()), shown)
    if alloc is None:
        return
    data = st.session_state.get(NPZ_KEY)
    if data is None:
        st.info("Trace a step (sidebar) or load a stream file to replay it.")
        return
    replay_section(data, alloc)


state.run_page(main)
