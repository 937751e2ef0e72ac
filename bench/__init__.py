"""willitfit's benchmark layer: traced runs (fake tensors, CPU), measured runs (GPU), and the DuckDB store."""
