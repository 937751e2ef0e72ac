"""Measuring on a GPU: the harness that runs one subprocess per case (`harness`), the worker it runs (`worker`,
`python -m bench.measure.worker`), the environment each row records (`env`)."""
