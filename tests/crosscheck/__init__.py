"""An independent, hand-written memory model: what autograd keeps, op by op, per family (as it stood before the
estimator learned every architecture from traces). It lives here only as a cross-check of the traced tier:
tests/test_activations_vs_trace.py compares CUDA-faithful traces with it. No product code imports it.
"""
