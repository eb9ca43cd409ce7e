"""Static compiles per size on a GPU (Config.compile_sizes="auto"): each capture size's static code is timed
against the dynamic code at warm-up and kept only where faster; real CUDA graphs equal eager either way."""

import pytest
import torch

import piecegraph

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    """An MLP with a full-row amax (a per-token scale): where Inductor's dynamic code lags static code most."""

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.up(x))
        scale = h.abs().amax().clamp(min=1e-6)  # over the whole tensor: token-mixing, so exact sizes only
        return x + self.down(h / scale) * scale


def test_auto_static_compiles_time_each_size_and_replay_equals_eager(record_result):
    torch.manual_seed(0)
    model = Block().cuda().eval()
    sizes = (1, 16, 256)
    graphed = piecegraph.compile(model, capture_sizes=sizes, compile_sizes="auto")
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 1024, device="cuda")
            expected = model(x)
            for _ in range(2):  # the capture, then a replay
                got = graphed(x)
                assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    stats = graphed.stats()
    assert set(stats["static_sizes"]) == set(sizes)
    assert all(entry["ms"] for entry in stats["static_sizes"].values())  # every size was timed on the GPU
    record_result("compile_sizes_gpu.json", "block_1024", {"static_sizes": {str(k): v for k, v in
                                                                           stats["static_sizes"].items()},
                                                          "static_compile_s": stats["static_compile_s"],
                                                          "replays": stats["replays"]})
