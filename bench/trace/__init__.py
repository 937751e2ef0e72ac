"""The traced tier's rows: one case traced on fake tensors into a run row (`cases`), the shipped grid (`grid`),
allocation streams for the allocator replay (`streams`)."""
