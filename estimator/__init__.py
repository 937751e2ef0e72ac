"""willitfit's evaluator, the lowest tier (docs/architecture.md): a workload's memory per GPU, per component and stage,
evaluated from a model's inventory and memory profile (data on disk) in pure Python + NumPy. Never imports torch,
transformers, DuckDB or Streamlit; a profile missing from disk is handed to the derivation tier (`tracer`) by
`estimator.store`, the one import of a higher tier."""
