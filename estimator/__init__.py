"""willitfit's analytic estimator: closed-form bytes for every memory component. Pure Python + NumPy."""
