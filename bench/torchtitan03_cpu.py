"""Run torchtitan 0.3.0's trainer on CPU with gloo, to time the peer on the same machine as shardlm
(``bench/bench_peer.py``; ``bench/torchtitan_cpu.py`` is the same for torchtitan 0.2.2).

A benchmark helper, not part of shardlm (torchtitan is not a dependency). torchtitan 0.3.0 assumes an
accelerator; these patches, applied here from outside the package, let its unmodified ``Trainer`` run its
``llama3`` module's ``llama3_debugmodel_ce_loss`` config (the debug model with the plain cross-entropy; the
default ``llama3_debugmodel`` chunks the loss) on a CPU:

0. ``torchtitan.distributed.minimal_async_ep.kernels`` imports ``triton`` (absent from CPU builds of torch)
   on every import of its models; the dense debug model never calls it, so a stub module stands in.
1. The device: torchtitan picks ``cuda`` when no accelerator is found; ``torch._utils`` is made to report
   ``cpu`` (before torchtitan is imported, it reads the device type at import) with a ``torch.cpu`` shim
   that has the few ``torch.cuda``-style calls torchtitan makes. torchtitan then picks gloo.
2. ``torch.distributed.set_timeout`` (torchtitan shortens the collectives' timeout after step 1) is
   missing from torch 2.13: a no-op stands in (the run is short).
3. Attention: its language models take only FlexAttention (no CPU backward in torch 2.13) or varlen
   (CUDA); each block's inner attention is swapped for its own ``ScaledDotProductAttention`` (causal
   SDPA, what its graph_trainer tests use). The data has no document positions, so no mask is built.
4. SPMD backend ``partial_dtensor`` (plain FSDP2 and DTensor only for model-parallel axes): its default
   ``spmd_types`` needs a newer torch's ``fully_shard``; the loss of a plain FSDP run is a plain tensor
   under it.
5. torchtitan sets FSDP's gradient divide factor to 1 (it divides by the global token count itself),
   so FSDP2 would reduce with ``ReduceOp.PREMUL_SUM``, which gloo rejects: every such module also gets
   ``set_force_sum_reduction_for_comms(True)``, a plain sum, the same result.
6. The wheel has no tokenizer or test data, and nothing may be downloaded: a stand-in tokenizer and a
   loader of seeded random tokens (vocabulary 2048), as shardlm's benchmark uses; validation and
   checkpoints off; CUDA graphs off (``--training.disable_cuda_graphs``), structured logging off.
7. ``Trainer.train_step`` is timed: rank 0 prints ``STEP_TIME step=N seconds``.

Usage (a virtual environment that sees the shared venv's torch through a ``.pth`` file)::

    python -m venv /work/tt-venv
    echo /work/venv/lib/python3.11/site-packages > /work/tt-venv/lib/python3.11/site-packages/workvenv.pth
    /work/tt-venv/bin/pip install torchtitan==0.3.0 torch==2.13.0
    OMP_NUM_THREADS=1 /work/tt-venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        bench/torchtitan03_cpu.py --training.local_batch_size 4 --training.seq_len 256 \\
        --training.steps 10 --training.mixed_precision_param float32 \\
        --training.mixed_precision_reduce float32 --activation_checkpoint.mode none

(any torchtitan ``--section.key`` override follows; ``--compile.enable`` compiles each block and the loss)
and take the median of steps 3-10.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import types

import torch
from cpu_as_device import report_cpu_as_device
from torch.distributed.fsdp import FSDPModule

VOCAB = 2048  # torchtitan's debugmodel vocabulary


# 0. a stand-in for the triton-only expert-parallel kernels
class _NoTriton(types.ModuleType):
    """Any kernel name; calling one raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def no_triton(*args, **kwargs):
            raise RuntimeError(f"{name}: the triton kernels are not available in this CPU run")
        return no_triton


sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = _NoTriton(
    "torchtitan.distributed.minimal_async_ep.kernels")


# 1. the CPU as torchtitan's device
report_cpu_as_device()  # bench/cpu_as_device.py, before torchtitan is imported

# 2. no set_timeout in torch 2.13
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = lambda timeout, group=None: None

# 5. a plain sum for FSDP's reduce-scatter (gloo has no PREMUL_SUM)
_set_divide_factor = FSDPModule.set_gradient_divide_factor


def _divide_factor_and_sum(self, factor):
    _set_divide_factor(self, factor)
    self.set_force_sum_reduction_for_comms(True)


FSDPModule.set_gradient_divide_factor = _divide_factor_and_sum

import torchtitan.tools.utils as titan_utils  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.observability import structured_logger as sl  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

assert titan_utils.device_type == "cpu", titan_utils.device_type


# 6. no tokenizer, random tokens
class NoTokenizer(BaseTokenizer):
    """A tokenizer that is never asked to encode (the loader makes token ids)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config=None, **kwargs):
        super().__init__()

    def encode(self, *args, **kwargs):
        raise RuntimeError("this CPU run has no tokenizer")

    def decode(self, *args, **kwargs):
        raise RuntimeError("this CPU run has no tokenizer")

    def get_vocab_size(self):
        return VOCAB


class RandomTokens(BaseDataLoader):
    """Endless batches of ``(local_batch_size, seq_len)`` token ids in ``[0, VOCAB)``, seeded per
    data-parallel rank; labels are the inputs shifted by one."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config=None, *, dp_rank=0, seq_len=256, local_batch_size=4, **kwargs):
        self.batch, self.seq = local_batch_size, seq_len
        self.gen = torch.Generator().manual_seed(1234 + dp_rank)

    def __iter__(self):
        while True:
            x = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=self.gen)
            yield {"input": x[:, :-1].contiguous()}, x[:, 1:].contiguous()

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


# 7. step timing
_train_step = Trainer.train_step


def _timed_train_step(self, data_iterator):
    start = time.perf_counter()
    _train_step(self, data_iterator)
    seconds = time.perf_counter() - start
    if torch.distributed.get_rank() == 0:
        print(f"STEP_TIME step={self.step} {seconds:.4f}", flush=True)


Trainer.train_step = _timed_train_step


def main(argv: list[str]) -> None:
    """Build torchtitan's llama3 debug config (plain cross-entropy) with ``argv``'s overrides, patched for
    the CPU (module docstring), and train it."""
    init_logger()
    config = ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel_ce_loss",
         "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs",
         "--debug.no_enable_structured_logging", "--validator.no_enable", "--checkpoint.no_enable",
         *argv])
    for layer in config.model_spec.model.layers:  # 3. causal SDPA
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.tokenizer = NoTokenizer.Config()
    config.dataloader = RandomTokens.Config()
    sl.init_structured_logger(source="training", output_dir=config.dump_folder, enable=False)
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
