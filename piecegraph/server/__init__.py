"""An OpenAI-compatible HTTP server on the continuous-batching engine (``piecegraph serve``).

``protocol`` (request models, errors), ``tokenizer`` (byte-level for the presets, a directory's own through
transformers), ``stream`` (incremental text, stop strings), ``sampling`` (request -> engine params), ``loop`` (the
engine on a thread), ``remote`` (the same loop in its own process: the default of ``serve``), ``metrics``
(Prometheus text), ``app`` (FastAPI routes), ``run`` (uvicorn), ``command`` (the CLI). The client of
``serve-bench --url`` lives with the benchmark (``piecegraph.serve.http_bench``). Needs ``pip install
'piecegraph[server]'``; ``import piecegraph`` never imports this package, and only ``app``/``run`` import FastAPI
or uvicorn.
"""
