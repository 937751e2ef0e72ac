"""willitfit: will this model fit in my GPU's memory?

    streamlit run app.py            # http://localhost:8501; WILLITFIT_DB=path picks another database

The entry script is only a router: each page in pages/ reads its widgets, calls `estimator` / `bench`, and draws.
"""
import streamlit as st

st.set_page_config(page_title="willitfit", page_icon=":material/memory:", layout="wide")

PAGES = [
    st.Page("pages/fit.py", title="Will it fit?", icon=":material/memory:", default=True),
    st.Page("pages/benchmarks.py", title="Benchmarks", icon=":material/table:"),
    st.Page("pages/curves.py", title="Curves", icon=":material/show_chart:"),
    st.Page("pages/calibrate.py", title="Calibrate", icon=":material/tune:"),
    st.Page("pages/multi_gpu.py", title="Multi-GPU", icon=":material/view_module:"),
    st.Page("pages/replay.py", title="Allocator replay", icon=":material/stacked_line_chart:"),
    st.Page("pages/contribute.py", title="Contribute", icon=":material/upload:"),
]

st.navigation(PAGES, position="top").run()
