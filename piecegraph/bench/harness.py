"""Timing primitives of the benchmark: one result row, CUDA-event medians, copy bandwidth, the environment.

Everything here is mode-agnostic; ``cases.py`` builds the inputs, ``modes.py`` the callables, ``sweep.py`` runs
them. All timings of one run come from one process on one device, so ratios between modes hold.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from piecegraph.graphs.capture import time_ms

if TYPE_CHECKING:
    from piecegraph.models import ModelFacts


@dataclass
class Row:
    """One measured (or skipped) cell: a mode at one decode batch or one prefill token count.

    ``size`` is the batch (decode) or the total token count (prefill); it is written as ``batch`` or ``tokens``.
    A skipped row has ``skipped`` set to the reason and ``None`` for every measurement.
    """

    mode: str
    phase: str  # "decode" | "prefill"
    size: int
    ms: float | None = None
    tok_s: float | None = None
    hbm_frac: float | None = None  # HBM floor (weights + KV bytes / peak bandwidth) over measured ms
    # decode only: ms per step of calls back to back, no sync between (the overlapped engine's decode loop: the
    # slower of host and device per step), and the same HBM floor over it; None on prefill and older results
    loop_ms: float | None = None
    loop_hbm_frac: float | None = None
    setup_s: float | None = None  # the mode's compile + capture (all bench sizes), the same on each of its rows
    pool_mib: float | None = None  # CUDA graph pool of the mode after every size was captured
    rel_err: float | None = None  # ||out - eager|| / ||eager|| on the same inputs and cache
    # --quant fp8: ||out - R|| / ||R||, R the unquantized model's eager output (the same weights before
    # quantization): how far each mode is from what the model would compute unquantized, eager FP8 included
    rel_err_float: float | None = None
    seqs: int | None = None  # prefill: sequences packed into the batch
    skipped: str | None = None
    note: str | None = None
    quant: str | None = None  # a run of several --quant values: the model's quantization on this row

    def to_json(self) -> dict[str, Any]:
        key = "batch" if self.phase == "decode" else "tokens"
        out: dict[str, Any] = {"mode": self.mode, "phase": self.phase, key: self.size}
        optional = ("loop_ms", "loop_hbm_frac", "rel_err_float", "seqs", "skipped", "note", "quant")
        for name in ("ms", "tok_s", "hbm_frac", "loop_ms", "loop_hbm_frac", "setup_s", "pool_mib", "rel_err",
                     "rel_err_float", "seqs", "skipped", "note", "quant"):
            value = getattr(self, name)
            if name in optional and value is None:
                continue  # optional keys appear only when they say something
            out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        """The inverse of :meth:`to_json` (for plotting or comparing saved results)."""
        size = data["batch"] if "batch" in data else data["tokens"]
        fields = {k: v for k, v in data.items() if k not in ("batch", "tokens")}
        return cls(size=size, **fields)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_bandwidth_gbs(device: torch.device | str, mib: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes over the median copy time).

    On CUDA a 1 GiB copy (well past L2), on CPU a 32 MiB one (a quick figure: the CPU smoke run only needs a
    number). Measured once per run: the HBM floor of every row divides by it.
    """
    device = torch.device(device)
    mib = mib or (1024 if device.type == "cuda" else 32)
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), warmup=2, repeats=10 if device.type == "cuda" else 5)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


# Vendor-stated peak HBM bandwidth (GB/s) by device name: the denominator of ``hbm_frac``, as the field's
# "percent of peak bandwidth" figures use it. Longest key first, so "H100 PCIe" wins over "H100".
_PEAK_HBM_GBS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "H20": 4000.0,
                 "GH200": 4000.0, "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0,
                 "L40S": 864.0, "L4": 300.0, "B200": 8000.0}


def peak_hbm_gbs(device: torch.device | str) -> float | None:
    """The vendor-stated peak memory bandwidth of ``device`` in GB/s, or ``None`` (CPU, or a GPU not in the
    table: the bench then divides by its measured copy bandwidth instead and says so in ``env``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(_PEAK_HBM_GBS, key=len, reverse=True):
        if key in name:
            return _PEAK_HBM_GBS[key]
    return None


def rel_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``||out - reference|| / ||reference||`` in float32 (both cut to the reference's rows)."""
    out = out[: reference.shape[0]].float()
    return ((out - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def environment(facts: ModelFacts, name: str, bandwidth_gbs: float, *, attention: str | None,
                quant: str = "bf16", world_size: int = 1, **extra: Any) -> dict[str, Any]:
    """The run's ``env`` in the one result schema (:func:`piecegraph.results.schema.environment`): the device the
    model's weights are on (``"cpu"`` for a CPU run on a GPU machine), versions, the resolved ``attention``
    backend, the model's name, shape (``facts.config``) and dtype, ``quant``, ``world_size``, date, commit, the
    measured copy bandwidth, the peak bandwidth ``hbm_frac`` divides by (``hbm_peak_gbs``; the measured copy
    bandwidth where the device's peak is not known), plus ``extra``."""
    from dataclasses import asdict

    import piecegraph
    from piecegraph.results.schema import device_name
    from piecegraph.results.schema import environment as result_environment

    return result_environment(
        attention=attention, model=name, dtype=facts.dtype, quant=quant, world_size=world_size,
        gpu=device_name(facts.device),
        cuda=torch.version.cuda if facts.device.type == "cuda" else None,
        python=platform.python_version(),
        piecegraph=getattr(piecegraph, "__version__", "?"),
        model_config=asdict(facts.config) if facts.config is not None else None,
        bandwidth_gbs=round(bandwidth_gbs, 1),
        hbm_peak_gbs=peak_hbm_gbs(facts.device),
        **extra,
    )
