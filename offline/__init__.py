"""Offline tools (docs/architecture.md), above the evaluator and the derivation: the CUDA caching-allocator model and
the replay of allocation streams (`offline.allocator`), the activation-constant fits (`offline.calibration`) and the
peers' formulas the accuracy report compares with (`offline.peers`). Pure Python + NumPy; nothing here runs when an
estimate is evaluated."""
