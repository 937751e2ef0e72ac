"""Contribute: build the `python -m bench measure` command for your GPU, then upload its rows.

Uploads go through the same code as `python -m bench ingest` (bench.store.ingest.ingest_files): every row is
validated, and one invalid row means nothing is written. The file is untrusted: it is size-bounded by
Streamlit (server.maxUploadSize in .streamlit/config.toml) and by bench.store.ingest, and parsed strictly.
"""
from __future__ import annotations

import hashlib
import shlex
import tempfile
from pathlib import Path

import streamlit as st

from bench.share import remote
from bench.share.push import push
from bench.share.remote import ShareError
from bench.store import app_data

from bench.trace import grid
from bench.measure.harness import MEASURED_STRATEGIES
from bench.store.ingest import IngestError, ingest_files
from estimator import spec
from estimator.presets import preset_names
from pages import _state as state, _data as reads

PAGE = "contrib"
UPLOAD_TYPES = ["jsonl", "ndjson", "csv", "parquet"]
DOCS = "docs/measuring.md"


def command_section() -> None:
    st.subheader("1. Measure on your GPU")
    st.markdown(f"Needs an NVIDIA GPU, PyTorch with CUDA and this repository (`pip install -r requirements.txt`). "
                f"Each case runs in its own process; an OOM is recorded as a row too. Details: `{DOCS}`.")
    names = preset_names()
    c = st.columns(3)
    models = c[0].multiselect("Models", names, default=["llama-3.2-1b"] if "llama-3.2-1b" in names else names[:1],
                              key=f"{PAGE}:models", help="Preset names (data/models/); one case grid per model.")
    mode = c[1].selectbox("Mode", spec.MODES, key=f"{PAGE}:mode", help="train: one optimizer step; infer: generate.")
    precision = c[2].selectbox("Precision", spec.PRECISIONS, key=f"{PAGE}:precision",
                               help="Compute dtype; bf16 needs an Ampere or newer GPU.")
    c = st.columns(3)
    method = c[0].selectbox("Method", spec.METHODS if mode == "train" else ("full",), key=f"{PAGE}:method",
                            help="full fine-tune or LoRA (QLoRA's 4-bit base is not measured: docs/measuring.md).")
    strategy = c[1].selectbox("Strategy", MEASURED_STRATEGIES if mode == "train" else ("single",),
                              key=f"{PAGE}:strategy",
                              help="single GPU, or DDP / FSDP2 over several GPUs of one machine (torchrun).")
    gpus = c[2].text_input("GPU counts", "2", key=f"{PAGE}:gpus", disabled=strategy == "single",
                           help="Comma-separated world sizes for ddp/fsdp.")
    c = st.columns(3)
    batches = c[0].text_input("Batch sizes", "1,2,4,8", key=f"{PAGE}:batches",
                              help="Comma-separated micro-batch sizes; larger ones find the OOM cliff.")
    seqs = c[1].text_input("Sequence lengths", "2048", key=f"{PAGE}:seqs", help="Comma-separated token counts.")
    contributor = c[2].text_input("Your name or handle", "", key=f"{PAGE}:contributor", max_chars=64,
                                  help="Stored in every row's `contributor` column (optional).")
    if not models:
        st.info("Pick at least one model.")
        return
    axes_text = {"mode": mode, "method": method, "precision": precision, "strategy": strategy,
                 "batch": batches, "seq": seqs}
    if strategy != "single":
        axes_text["gpus"] = gpus
    ints = ("batch", "seq", "gpus")
    try:  # the same parser and grid expansion as the command itself (bench.trace.grid)
        axes = {k: grid.parse_list(k, v, int if k in ints else str, None) for k, v in axes_text.items()}
        cases, skipped = grid.expand(models, axes)
    except ValueError as e:
        st.error(f"{e}. Fix that field above.")
        return
    cmd = ["python", "-m", "bench", "measure", "--model", ",".join(models)]
    for k, values in axes.items():
        cmd += [f"--{k.replace('_', '-')}", ",".join(map(str, values))]
    cmd += ["--out", "runs.jsonl"]
    if contributor.strip():
        cmd += ["--contributor", contributor.strip()]
    st.code(shlex.join(cmd), language="bash")
    notes = [f"{len(cases)} case(s).", grid.summarize_skipped(skipped),
             "Rerun the same command to resume: cases already in runs.jsonl are skipped. Then upload runs.jsonl below, "
             "or run `python -m bench ingest runs.jsonl`."]
    st.caption(" ".join(n for n in notes if n))


@st.cache_data(show_spinner="Checking every row", max_entries=4)
def _report(data: bytes, suffix: str):
    with tempfile.TemporaryDirectory(prefix="willitfit-upload-") as tmp:
        path = Path(tmp) / f"upload{suffix}"
        path.write_bytes(data)
        return app_data.validation_report(path)


def _ingest(data: bytes, suffix: str):
    with tempfile.TemporaryDirectory(prefix="willitfit-upload-") as tmp:
        path = Path(tmp) / f"upload{suffix}"
        path.write_bytes(data)
        return ingest_files([path], reads.db_path())


def _push(data: bytes, suffix: str):
    with tempfile.TemporaryDirectory(prefix="willitfit-push-") as tmp:
        path = Path(tmp) / f"upload{suffix}"
        path.write_bytes(data)
        return push([path])


def push_section(data: bytes, suffix: str) -> None:
    """After a local ingest of this file: offer to push it to the shared dataset (WILLITFIT_DATASET)."""
    st.subheader("3. Share the rows")
    url = remote.configured()
    st.caption(f"Pushes the same rows as one contribution to the shared dataset ({url or remote.ENV + ' is not set'}); "
               "on a Hugging Face dataset this opens a pull request that maintainers review. Details: "
               f"`{DOCS}`, section *The shared dataset*.")
    if not st.button("Push to the shared dataset", key=f"{PAGE}:push",
                     help="Validated again, written as one parquet file with its manifest and uploaded."):
        return
    try:
        report = _push(data, suffix)
    except (ValueError, ShareError) as e:
        st.error(f"{e}. Nothing was pushed.")
        return
    if not report.uploaded:
        st.error("Nothing was pushed: " + ("; ".join(f"line {line}: {why}" for _, line, why in report.rejected[:10])
                                           or "the file holds no rows"))
        return
    st.success(f"Pushed {report.rows} row(s) as contribution {report.name}: {report.where}")


def upload_section() -> None:
    st.subheader("2. Upload the rows")
    limit_mb = st.get_option("server.maxUploadSize")
    up = st.file_uploader("runs.jsonl", type=UPLOAD_TYPES, key=f"{PAGE}:upload",
                          help=f"JSON Lines written by `python -m bench measure` (CSV and Parquet exports work too). "
                               f"At most {limit_mb} MB (server.maxUploadSize).")
    st.caption(f"Upload limit: {limit_mb} MB per file (set by server.maxUploadSize in .streamlit/config.toml). "
               "For larger files use `python -m bench ingest FILE` on the command line.")
    if up is None:
        return
    suffix = Path(up.name).suffix.lower()
    data = up.getvalue()
    try:
        report, n_valid, n_invalid = _report(data, suffix)
    except IngestError as e:
        st.error(f"{up.name} cannot be read: {e}. Nothing was written.")
        return
    c = st.columns(3)
    c[0].metric("Rows", f"{n_valid + n_invalid:,}")
    c[1].metric("Valid", f"{n_valid:,}")
    c[2].metric("Invalid", f"{n_invalid:,}")
    if n_invalid:
        st.error(f"{n_invalid} row(s) are invalid, so nothing can be inserted (one file is all or nothing). "
                 "Fix the rows listed below and upload the file again.")
        st.dataframe(report[~report["valid"]][["line", "problems"]], hide_index=True)
    if n_valid + n_invalid == 0:
        st.warning(f"{up.name} holds no rows.")
        return
    st.markdown("**Preview**")
    st.dataframe(report, hide_index=True, column_config={"valid": st.column_config.CheckboxColumn("valid")})
    if st.button("Insert into the database", type="primary", disabled=bool(n_invalid), key=f"{PAGE}:insert",
                 help="Writes every row in one transaction; rows whose run_id is already stored are skipped."):
        result = _ingest(data, suffix)
        if result.written:
            st.session_state[f"{PAGE}:ingested"] = hashlib.sha256(data).hexdigest()
        if result.written and not result.inserted:
            st.info(f"Nothing new: all {result.duplicates} row(s) are already stored (same run_id), so nothing "
                    "was inserted.")
        elif result.written:
            st.success(f"Inserted {result.inserted} new row(s)"
                       + (f"; {result.duplicates} already stored were skipped" if result.duplicates else "")
                       + ". They now show on the Benchmarks page.")
        else:
            st.error("Nothing was written: " + "; ".join(f"line {line}: {why}" for _, line, why in result.rejected[:10]))
    if st.session_state.get(f"{PAGE}:ingested") == hashlib.sha256(data).hexdigest():
        push_section(data, suffix)


def main() -> None:
    st.title("Contribute")
    st.caption("Measured rows from real GPUs make the curves honest. Measure, then upload.")
    command_section()
    upload_section()


state.run_page(main)
