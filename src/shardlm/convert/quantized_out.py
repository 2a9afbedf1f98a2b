"""The quantised export of a quantisation-aware run (``train.qat``): the trained Hugging Face model directory
quantised with the scheme's torchao config, in the form transformers loads.

transformers' ``TorchAoConfig(quant_type=<torchao config>, modules_to_not_convert=[...])`` quantises the
``nn.Linear`` weights as the model loads, and ``save_pretrained`` writes them as torchao tensor subclasses
flattened into safetensors (``IntxUnpackedToInt8Tensor``: int8 values, scales, zero points), with the config
recorded under ``quantization_config`` in ``config.json``. ``AutoModelForCausalLM.from_pretrained(dir)`` then
loads the quantised model (torchao must be installed). Quantising the trained weights with the base config is
what torchao's QAT ``step="convert"`` does after swapping the fake-quantised layers back to ``nn.Linear``: the
quantised model computes what the fake-quantised one trained with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shardlm.atomic import atomic_directory
from shardlm.model.qat import GROUP_SIZE, base_config, check_scheme, group_of

#: written beside the weights: the scheme and the layers left in full precision
QAT_RECORD = "qat.json"
#: files of a model directory that the quantised one writes itself
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def save_quantized_dir(model_dir: str | Path, out_dir: str | Path, scheme: str, excluded: list[str],
                       group_size: int = GROUP_SIZE) -> Path:
    """Write ``model_dir`` (an HF model directory of the trained weights) quantised with ``scheme``
    (:data:`shardlm.model.qat.QAT_SCHEMES`) to ``out_dir``, atomically; ``excluded``: the ``nn.Linear`` names
    left unquantised (:func:`shardlm.model.qat.qat_excluded`); ``group_size``: the int4 schemes' inputs per
    scale (``train.qat_group_size``). The tokenizer's files are copied; ``qat.json`` records the scheme, the
    group size, torchao's config class and the excluded layers. Returns ``out_dir``.

    Raises:
        ConfigError: an unknown scheme.
    """
    check_scheme(scheme)
    from transformers import AutoModelForCausalLM, TorchAoConfig

    src, out = Path(model_dir), Path(out_dir)
    config = base_config(scheme, group_size)
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=TorchAoConfig(config, modules_to_not_convert=list(excluded)))
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        for path in sorted(src.iterdir()):
            if path.is_file() and path.name not in WEIGHT_FILES and not path.name.endswith(".safetensors"):
                shutil.copy2(path, tmp / path.name)
        record = {"scheme": scheme, "group_size": group_of(scheme, group_size),
                  "torchao_config": type(config).__name__, "not_quantized": list(excluded),
                  "source": str(src)}
        (tmp / QAT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out
