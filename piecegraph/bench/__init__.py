"""``piecegraph bench``: every capture mode timed side by side in one process.

cases (inputs) -> modes (callables, setup timed) -> sweep (rows) -> report / plot (outputs); profile takes one
decode step apart; meta_pcg adapts Meta's ``piecewise_cuda_graphs`` as a baseline; command is the CLI.
"""
