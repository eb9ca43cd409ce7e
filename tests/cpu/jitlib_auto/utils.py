"""The decorator on every public function, shaped like FlashInfer's ``backend_requirement``: a public ``wrapper``
closure (one code object for all the functions it wraps) that checks ``backend`` and forwards ``*args, **kwargs``."""

import functools


def api(backends=()):
    """Check the ``backend`` keyword against ``backends`` (when given), then call the function."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            backend = kwargs.get("backend")
            if backends and backend is not None and backend not in backends:
                raise ValueError(f"unknown backend {backend!r}; available: {list(backends)}")
            return func(*args, **kwargs)

        return wrapper

    return decorator
