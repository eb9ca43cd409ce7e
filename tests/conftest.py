import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# No per-example deadline: the examples compile and trace, and CI machines are shared (timing is not what the
# property tests check). HYPOTHESIS_PROFILE=long runs more examples in the tests that do not set their own count.
settings.register_profile("ci", deadline=None)
settings.register_profile("long", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_RESULTS: dict[str, dict] = {}  # file name -> {key: row} the GPU tests recorded into it, this session


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def record_result():
    """``record(file, key, value)``: keep what a GPU run showed in ``$PIECEGRAPH_OUT/<file>``, in the result
    schema (``piecegraph.results``): benchmark ``gpu-tests/<file stem>``, one row per key (``{"key": key,
    **value}`` for a dict, else ``{"key": key, "value": value}``). Nothing is written without the variable."""
    from piecegraph.results.schema import environment, write_result

    def record(file: str, key: str, value) -> None:
        rows = _RESULTS.setdefault(file, {})
        rows[key] = {"key": key, **value} if isinstance(value, dict) else {"key": key, "value": value}
        out = os.environ.get("PIECEGRAPH_OUT")
        if out:
            env = environment(attention=None, model=None, dtype=None, quant=None)
            write_result(os.path.join(out, file), f"gpu-tests/{Path(file).stem}", env, list(rows.values()))

    return record
