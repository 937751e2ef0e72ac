"""The Allocator replay page, run from app.py with AppTest: a stream in the session (as the trace button or an
upload leaves it) is replayed and the numbers on screen are offline.allocator.replay's; a bad alloc-conf is one
error line; the trace button traces a small preset."""
from __future__ import annotations

import io
from pathlib import Path

from streamlit.testing.v1 import AppTest

from estimator.alloc_conf import parse_alloc_conf
from offline.allocator.replay import replay
from offline.allocator.stream import Stream
from estimator.units import fmt_bytes

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PAGE = "pages/replay.py"
MiB = 2**20


def stream() -> Stream:
    """Hand-made: tensors of 3, 5, 4 and 12 MiB over three stages (large-pool segments, one split)."""
    events = [("alloc", 0, 3 * MiB, "forward"), ("alloc", 1, 5 * MiB, "forward"), ("free", 0, 3 * MiB, "backward"),
              ("alloc", 2, 4 * MiB, "backward"), ("alloc", 3, 12 * MiB, "optimizer"),
              ("free", 1, 5 * MiB, "optimizer"), ("free", 2, 4 * MiB, "optimizer"), ("free", 3, 12 * MiB, "optimizer")]
    return Stream.from_events(events, {"source": "hand", "model": "unit"})


def npz(s: Stream) -> bytes:
    buf = io.BytesIO()
    s.save(buf)
    return buf.getvalue()


def page(query: dict | None = None, data: bytes | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    if query:
        at.query_params.update(query)
    at.run()
    if data is not None:
        at.session_state["replay:npz"] = data
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metric(at, label):
    return next(m.value for m in at.metric if m.label == label)


def test_replay_page_shows_the_library_numbers():
    s = stream()
    at = page(data=npz(s))
    r = replay(s)
    assert not at.error, [e.value for e in at.error]
    assert metric(at, "Peak allocated") == fmt_bytes(r.overall.peak_allocated_bytes)
    assert metric(at, "Peak reserved") == fmt_bytes(r.overall.peak_reserved_bytes)
    assert metric(at, "Fragmentation at the peak") == fmt_bytes(r.overall.fragmentation_at_peak_bytes)
    table = at.dataframe[0].value
    assert table["stage"].tolist() == ["forward", "backward", "optimizer"]
    at.text_input(key="replay:alloc").set_value("expandable_segments:True").run()
    r2 = replay(s, parse_alloc_conf("expandable_segments:True"))
    assert metric(at, "Peak reserved") == fmt_bytes(r2.overall.peak_reserved_bytes)
    assert at.query_params["alloc"] == "expandable_segments:True"


def test_bad_alloc_conf_is_one_error_and_no_stream_is_a_hint():
    at = page(query={"alloc": "expandable_segments:maybe"}, data=npz(stream()))
    assert len(at.error) == 1 and "expandable_segments" in at.error[0].value
    at = page()
    assert any("Trace a step" in i.value for i in at.info)


def test_trace_button_traces_a_small_preset():
    at = page()
    at.selectbox(key="replay:model").set_value("qwen2.5-0.5b")
    at.selectbox(key="replay:kind").set_value("infer")
    at.number_input(key="replay:seq").set_value(16).run()
    at.button(key="replay:trace").click().run()
    assert not at.exception, [e.value for e in at.exception]
    s = Stream.load(io.BytesIO(at.session_state["replay:npz"]))
    assert s.meta["model"] == "qwen2.5-0.5b" and "decode" in s.stage_names
    assert not at.error, [e.value for e in at.error]
    assert metric(at, "Peak reserved") == fmt_bytes(replay(s).overall.peak_reserved_bytes)
