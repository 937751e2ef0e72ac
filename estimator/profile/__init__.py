"""Memory profiles: each moment of a step as exact polynomials in the sizes, derived from the model's own code.

- `poly`: the polynomials and their exact fit.
- `profile`: `Profile` / `Piece` / `Moment`, JSON, pure Python + NumPy (what estimate() evaluates).
- `derive`: traces of a reduced-depth model at a few sizes -> fit -> verify -> full depth (imports torch).
- `store`: where profiles live (shipped under data/profiles, cached under ~/.cache/willitfit) and derive-on-miss.
"""
