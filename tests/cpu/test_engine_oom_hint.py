"""An engine whose graph capture runs out of device memory says what the KV cache took and which setting to lower
(the FP8 MoE preset's breakable engine did, on the H200, with the cache at 0.85 of the free memory)."""

import pytest
import torch

from piecegraph.models import TINY, Decoder
from piecegraph.serve import Engine, EngineConfig
from piecegraph.serve.executor import Executor


def _oom(self, cache, progress=None):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 330.00 MiB.")


@pytest.mark.parametrize("pages", [None, 40])
def test_a_capture_oom_names_the_kv_setting_to_lower(monkeypatch, pages):
    monkeypatch.setattr(Executor, "capture", _oom)
    model = Decoder.random(TINY, seed=0).eval()
    config = EngineConfig(mode="piecewise", compiler="eager", emulate_graphs=True, max_num_seqs=4, page_size=8,
                          max_seq_len=64, num_pages=pages)
    with pytest.raises(torch.OutOfMemoryError) as err:
        Engine(model, config)
    message = str(err.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 330.00 MiB.")  # torch's own words first
    assert "graph capture ran out of device memory" in message and " GiB)" in message
    assert ("EngineConfig.num_pages" if pages else "EngineConfig.kv_cache_memory") in message
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_a_capture_oom_with_the_callers_cache_names_that_cache(monkeypatch):
    from piecegraph.attention import KVCache

    monkeypatch.setattr(Executor, "capture", _oom)
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache(TINY, num_pages=24, page_size=8, max_seq_len=64)
    config = EngineConfig(mode="piecewise", compiler="eager", emulate_graphs=True, max_num_seqs=4, page_size=8,
                          max_seq_len=64)
    with pytest.raises(torch.OutOfMemoryError) as err:
        Engine(model, config, cache=cache)
    message = str(err.value)
    assert "24 pages" in message and "Engine(cache=...)" in message
    assert "kv_cache_memory" not in message and "EngineConfig.num_pages" not in message
