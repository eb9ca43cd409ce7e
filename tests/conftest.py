import json
import os

import pytest
import torch

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
