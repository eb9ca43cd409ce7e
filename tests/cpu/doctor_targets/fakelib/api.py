"""A forwarding decorator in a module of its own, as FlashInfer 0.7's api_logging wraps its public functions."""

import functools


def api_logged(fn):
    @functools.wraps(fn)
    def _auto_dump_wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return _auto_dump_wrapper
