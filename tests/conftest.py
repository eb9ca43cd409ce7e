import json
import os

import pytest
import torch
from hypothesis import settings

# No per-example deadline: the examples compile and trace, and CI machines are shared (timing is not what the
# property tests check). HYPOTHESIS_PROFILE=long runs more examples in the tests that do not set their own count.
settings.register_profile("ci", deadline=None)
settings.register_profile("long", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_RESULTS: dict[str, dict] = {}  # file name -> what the GPU tests recorded into it, this session


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def record_result():
    """``record(file, key, value)``: keep what a GPU run showed in ``$PIECEGRAPH_OUT/<file>`` (JSON), for the
    closing note; each file starts with the torch version and the device. Nothing is written without the
    variable."""

    def record(file: str, key: str, value) -> None:
        results = _RESULTS.setdefault(file, {"torch": torch.__version__, "device": torch.cuda.get_device_name()})
        results[key] = value
        out = os.environ.get("PIECEGRAPH_OUT")
        if out:
            with open(os.path.join(out, file), "w") as f:
                json.dump(results, f, indent=1)

    return record
