"""Run torchtitan 0.2.2's trainer on CPU with gloo, to time the peer on the same machine as shardlm.

A benchmark helper, not part of shardlm (torchtitan is not a dependency). torchtitan assumes an
accelerator; five small patches, applied here from outside the package, let its unmodified
``Trainer`` run on a CPU:

1. ``torchtitan.models.moe.kernels`` imports ``triton`` (absent from CPU builds of torch) on every
   import of torchtitan; dense Llama 3 never calls it, so a stub module stands in.
2. torchtitan picks ``cuda`` when no accelerator is found; ``torch._utils`` is made to report ``cpu``
   (before torchtitan is imported, since it reads the device type at import) with a ``torch.cpu``
   shim that has the few ``torch.cuda``-style calls torchtitan makes. torchtitan then picks gloo.
3. The wheel has no tokenizer or test data, and nothing may be downloaded: a ``llama3_cpu`` train
   spec is llama3's with no tokenizer and a loader of seeded random tokens (vocabulary 2048), as
   shardlm's benchmark uses.
4. torchtitan sets FSDP's gradient divide factor to 1 (it divides the loss by the global token
   count itself), so FSDP2 would reduce with ``ReduceOp.PREMUL_SUM``, which gloo rejects; every FSDP
   module is also set to ``set_force_sum_reduction_for_comms(True)``: a plain sum, the same result.
5. A ``Trainer`` subclass times ``train_step`` and prints ``STEP_TIME step=N seconds`` on rank 0.

Usage (a virtual environment that reuses this machine's torch; pin torch so pip keeps the CPU build)::

    python -m venv --system-site-packages /tmp/ttenv
    /tmp/ttenv/bin/pip install torchtitan==0.2.2 torch==2.13.0
    OMP_NUM_THREADS=1 /tmp/ttenv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        bench/torchtitan_cpu.py --model.name llama3_cpu --model.flavor debugmodel \\
        --training.local_batch_size 4 --training.seq_len 256 --training.steps 10 \\
        --training.mixed_precision_param bfloat16 --training.mixed_precision_reduce float32 \\
        --optimizer.implementation fused --activation_checkpoint.mode none --metrics.log_freq 1 \\
        --lr_scheduler.warmup_steps 2 --job.dump_folder /tmp/torchtitan-out

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

# 1. a stand-in for the triton-only MoE kernels
_moe_kernels = types.ModuleType("torchtitan.models.moe.kernels")


def _no_triton(*args, **kwargs):
    raise RuntimeError("the MoE triton kernels are not available in this CPU run")


_moe_kernels.generate_permute_indices = _moe_kernels.fill_indices_wrapper = _no_triton
_moe_kernels.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
sys.modules["torchtitan.models.moe.kernels"] = _moe_kernels


# 2. the CPU as torchtitan's device
report_cpu_as_device()  # bench/cpu_as_device.py, before torchtitan is imported

import torchtitan.models.llama3.infra.parallelize as llama3_parallelize  # noqa: E402
import torchtitan.protocols.train_spec as train_spec  # noqa: E402
import torchtitan.tools.utils as titan_utils  # noqa: E402
from torchtitan import train as titan_train  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.models.llama3 import get_train_spec  # noqa: E402

assert titan_utils.device_type == "cpu", titan_utils.device_type

# 4. a plain sum for FSDP's reduce-scatter (gloo has no PREMUL_SUM)
_disable_division = llama3_parallelize.disable_fsdp_gradient_division


def _disable_division_with_sum(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


llama3_parallelize.disable_fsdp_gradient_division = _disable_division_with_sum


# 3. random tokens instead of a tokenizer and a data set
class RandomTokens(BaseDataLoader):
    """Endless batches of ``(batch, seq)`` token ids in ``[0, VOCAB)``; labels are the inputs shifted
    by one."""

    def __init__(self, batch: int, seq: int, seed: int):
        self.batch, self.seq = batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            x = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=self.gen)
            yield {"input": x[:, :-1].contiguous()}, x[:, 1:].contiguous()

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def _random_tokens(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    return RandomTokens(job_config.training.local_batch_size, job_config.training.seq_len, 1234 + dp_rank)


train_spec.register_train_spec(
    "llama3_cpu",
    dataclasses.replace(get_train_spec(), build_tokenizer_fn=None, build_dataloader_fn=_random_tokens))


# 5. step timing
class TimedTrainer(titan_train.Trainer):
    """torchtitan's trainer, printing each step's wall time (and the optimizer's flags once) on rank 0."""

    def train_step(self, data_iterator):
        start = time.perf_counter()
        super().train_step(data_iterator)
        seconds = time.perf_counter() - start
        if torch.distributed.get_rank() == 0:
            if self.step == 1:
                opt = self.optimizers.optimizers[0]
                print(f"optimizer {type(opt).__name__} fused={opt.defaults.get('fused')} "
                      f"foreach={opt.defaults.get('foreach')}", flush=True)
            print(f"STEP_TIME step={self.step} {seconds:.4f}", flush=True)


if __name__ == "__main__":
    titan_train.main(TimedTrainer)
