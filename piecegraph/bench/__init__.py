"""``piecegraph bench``: every capture mode timed side by side in one process, on paged KV caches.

cases (inputs) -> modes (callables, setup timed) -> sweep (rows) -> report / plot (outputs); profile takes one
decode step apart and prices one call of the attention op; meta_pcg adapts Meta's ``piecewise_cuda_graphs`` as
a baseline; command is the CLI (``--attention`` picks the caches' backend).
"""
