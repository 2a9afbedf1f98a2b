"""Model FLOPs, peak matrix-multiply rate and MFU (model FLOPs utilisation).

MFU = achieved model FLOP/s ÷ peak FLOP/s (Chowdhery et al., "PaLM", 2022, appendix B). Model
FLOPs count the forward and backward of the model as written, not recomputation (activation
checkpointing does not raise MFU).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.model.config import ModelConfig
from shardlm.model.cpu_matmul import CPUINFO, bf16_linear_fp32
from shardlm.model.hf_backend import build_causal_lm
from shardlm.model.moe import inactive_expert_params


def flops_per_token(n_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token, forward + backward: 6·N + 12·L·H·Q·T (PaLM, appendix B).

    Args:
        n_params: N, all parameters except the input embedding table (the output projection
            counted once, tied or not).
        n_layers: L; n_heads: H query heads; head_dim: Q; seq_len: T tokens per sequence.

    6·N is 2 FLOPs per multiply-add of every weight, ×3 for forward + backward; 12·L·H·Q·T is the
    attention score and value products (causal masking not discounted, as in PaLM).
    """
    return 6 * n_params + 12 * n_layers * n_heads * head_dim * seq_len


_N_CACHE: dict[str, int] = {}


def flops_params(cfg: ModelConfig) -> int:
    """N of :func:`flops_per_token` for a model of shape ``cfg``: computed from the shape, embedding excluded
    (the meta-device model that counts it is built once per shape). A mixture of experts counts its *active*
    parameters: each token runs k of a layer's E experts
    (:func:`shardlm.model.moe.inactive_expert_params`)."""
    key = repr(cfg)
    if key not in _N_CACHE:
        with torch.device("meta"):
            model = build_causal_lm(cfg)  # shardlm's decoder or transformers'
        n = sum(p.numel() for name, p in model.named_parameters() if name != "model.embed_tokens.weight")
        if cfg.tie_embeddings:
            # the shared table is listed once, as the embedding: count it as the output projection
            n += model.lm_head.weight.numel()
        _N_CACHE[key] = n - inactive_expert_params(model)
    return _N_CACHE[key]


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """:func:`flops_per_token` for a model of shape ``cfg`` (N: :func:`flops_params`)."""
    return flops_per_token(flops_params(cfg), cfg.n_layers, cfg.n_heads, cfg.head_dim, seq_len)


def model_flops(cfg: ModelConfig, tokens: int, squared_lengths: int | float) -> int | float:
    """Training FLOPs (forward + backward) of ``tokens`` tokens whose sequences hold documents of lengths n:
    6·N·tokens + 12·L·H·Q·Σ n² (N: :func:`flops_params`).

    PaLM's per-token attention term 12·L·H·Q·T (appendix B; :func:`flops_per_token`, causal masking not
    discounted) counts a sequence of T tokens as T² score and value products. Under block-causal attention
    each document of n tokens (padding one of its own) attends only within itself: n² of them, so a sequence
    counts Σ n² over its documents (Σ n² = T² for a causal sequence: then exactly
    :func:`model_flops_per_token` × tokens, in integers). Sliding windows are not discounted, as under causal
    attention. The trainer's logged FLOPs and MFU and the planner both count with this
    (:mod:`shardlm.plan.documents`).

    Args:
        tokens: tokens of the sequences (padding included); squared_lengths: Σ n² over their documents (an
            int, or the planner's mean per sequence × sequences, a float).
    """
    return (6 * flops_params(cfg) * tokens
            + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * squared_lengths)


def squared_document_lengths(documents: torch.Tensor) -> int:
    """Σ over rows of Σ n² over each row's documents (runs of equal index), for :func:`model_flops`.

    Args:
        documents: (B, T) int64 on the host, each document one run of equal ids: each input token's document
            index (0 from each row's first token; :func:`shardlm.data.packing.batch_documents`).
    """
    if documents.numel() == 0:
        return 0
    b, t = documents.shape
    keys = (documents - documents[:, :1]) + torch.arange(b, dtype=torch.int64).unsqueeze(1) * (t + 1)
    counts = torch.unique_consecutive(keys.flatten(), return_counts=True)[1]  # host tensors: no device read
    return int((counts * counts).sum())


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024,
                         seconds: float = 1.0, fp32_multiply: bool = False) -> float:
    """Measured dense matrix-multiply rate on this rank, in FLOP/s (2·size³ FLOPs per product).

    With ``fp32_multiply`` the bf16 products go through the kernel training uses on CPUs without bf16
    instructions (:func:`shardlm.model.cpu_matmul.bf16_linear_fp32`, upcasts included), so MFU is
    measured against the rate of the kernel that runs.

    All ranks of the default process group (if any) start together after a barrier, so the rate
    is what each rank gets while the others run on the same cores or GPUs: the peak that MFU is
    measured against, in the same dtype, processes and threads as training. Runs about ``seconds``
    after one warm-up product; returns the 90th percentile of the per-product rates (a peak,
    robust to a few slow products on a shared machine). On a GPU each rate is timed over 20 products
    between synchronisations (use ``size`` >= 8192 there: smaller products do not fill the GPU), and fp32
    products run as TF32 when PyTorch's switch allows it (``parallel.tf32``), as in training.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    product = bf16_linear_fp32 if fp32_multiply else torch.mm  # bf16_linear_fp32 is a @ b.T: the same FLOPs
    product(a, b)
    sync()
    if dist.is_initialized():
        dist.barrier()
    # on a GPU one product is too short to time alone (launch and synchronisation would dominate): time a
    # run of products between two synchronisations, the queue kept full as in training
    per_timing = 1 if device.type == "cpu" else 20
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(rates) < 3:
        t0 = time.perf_counter()
        for _ in range(per_timing):
            product(a, b)
        sync()
        rates.append(per_timing * 2 * size**3 / (time.perf_counter() - t0))
    if dist.is_initialized():
        dist.barrier()
    rates.sort()
    return rates[min(len(rates) - 1, int(0.9 * len(rates)))]


#: fp32 FLOPs per cycle and core of the widest vector fused multiply-add, by ``/proc/cpuinfo`` flag, widest
#: first: two FMA units x lanes x 2 (AVX-512: 2 x 16 x 2; AVX2 + FMA: 2 x 8 x 2), the figure of Intel's server
#: cores since Skylake-SP and of AMD's Zen 4/5 (AVX-512 over 2 x 256 bits, twice the FMA ports: the same
#: per cycle)
CPU_FP32_FLOPS_PER_CYCLE = (("avx512f", 64), ("fma", 32), ("avx", 16), ("sse2", 8))
#: bf16 FLOPs per cycle and core where bf16 runs natively (PyTorch's oneDNN kernels): AMX tiles (16 x 32 x 16
#: multiply-adds every 16 cycles: 1,024) or AVX512-BF16's dot products (2 x 32 x 2: 128); elsewhere as fp32
CPU_BF16_FLOPS_PER_CYCLE = (("amx_bf16", 1024), ("avx512_bf16", 128))
#: without /proc/cpuinfo's flags (not x86 Linux): a 128-bit vector FMA on 2 units (2 x 4 x 2)
CPU_DEFAULT_FLOPS_PER_CYCLE = 16


@dataclass(frozen=True)
class CpuPeak:
    """A CPU's nominal dense peak per rank: ``cores`` x ``ghz`` x ``flops_per_cycle`` (per core), and why."""

    cores: int
    ghz: float
    flops_per_cycle: int
    instructions: str

    @property
    def flops(self) -> float:
        """FLOP/s."""
        return self.cores * self.ghz * 1e9 * self.flops_per_cycle

    def describe(self) -> str:
        return (f"nominal CPU peak: {self.cores} core(s) x {self.ghz:.2f} GHz x {self.flops_per_cycle} "
                f"FLOP/cycle ({self.instructions})")


def cpu_clock_ghz(
    cpuinfo: Path = CPUINFO, sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cpufreq")
) -> float | None:
    """The CPU's nominal clock in GHz, the same on every call: cpufreq's ``base_frequency``, else the ``@
    2.60GHz`` of the model name, else cpufreq's ``cpuinfo_max_freq``, else the highest ``cpu MHz`` of
    ``cpuinfo`` (a virtual machine's constant TSC rate); None when none is readable."""
    try:
        return int((sysfs / "base_frequency").read_text()) / 1e6  # kHz
    except (OSError, ValueError):
        pass
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    named = re.search(r"^model name\s*:.*@\s*([\d.]+)\s*GHz", text, re.M)
    if named:
        return float(named.group(1))
    try:
        return int((sysfs / "cpuinfo_max_freq").read_text()) / 1e6
    except (OSError, ValueError):
        pass
    mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)]
    return max(mhz) / 1e3 if mhz else None


def cpu_peak(precision: str, fp32_multiply: bool, cores: int, cpuinfo: Path = CPUINFO,
             clock_ghz: float | None = None) -> CpuPeak | None:
    """The nominal dense peak of ``cores`` cores of this CPU in ``precision`` (``bf16`` or ``fp32``): cores x
    the nominal clock (:func:`cpu_clock_ghz`, or ``clock_ghz``) x FLOPs per cycle and core of the widest
    instructions its flags name (:data:`CPU_BF16_FLOPS_PER_CYCLE` for bf16 multiplied natively, else
    :data:`CPU_FP32_FLOPS_PER_CYCLE`). A fixed figure, the same on every run of the machine, unlike a measured
    rate (the issue behind it: start-up measurements of 0.03-0.10 TFLOP/s on one shared machine); the
    datasheet's equivalent for a CPU, an upper bound (turbo clocks and AVX-512 down-clocking not counted).
    None when the clock cannot be read."""
    ghz = clock_ghz if clock_ghz is not None else cpu_clock_ghz(cpuinfo)
    if ghz is None:
        return None
    try:
        flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
                 for f in line.partition(":")[2].split()}
    except OSError:
        flags = set()
    table = (
        CPU_BF16_FLOPS_PER_CYCLE if precision == "bf16" and not fp32_multiply else ()
    ) + CPU_FP32_FLOPS_PER_CYCLE
    flag, per_cycle = next(((f, n) for f, n in table if f in flags),
                           ("no x86 vector flags", CPU_DEFAULT_FLOPS_PER_CYCLE))
    return CpuPeak(cores, ghz, per_cycle, flag)


def mfu(tokens_per_s_per_rank: float, flops_per_token_: float, peak_flops_per_rank: float) -> float:
    """Model FLOPs utilisation in [0, 1]: tokens/s per rank × FLOPs per token ÷ peak FLOP/s per rank."""
    return tokens_per_s_per_rank * flops_per_token_ / peak_flops_per_rank
