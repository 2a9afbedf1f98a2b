"""Make a shallower student from a Hugging Face Llama-family model directory: every ``--every``-th decoder
layer of the teacher (0, k, 2k, ...; DistilBERT's initialisation, Sanh et al. 2019), with the teacher's
embedding, final norm and output projection, written as a model directory of the same tokenizer.

    python examples/distill/make_student.py models/smollm2-135m models/smollm2-135m-half --every 2

The student has ``ceil(layers / every)`` layers; everything else in ``config.json`` is the teacher's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def make_student(teacher: Path, out: Path, every: int) -> int:
    """Write the student into ``out``; returns its number of layers.

    Raises:
        SystemExit: ``teacher`` is not a model directory with one ``model.safetensors``, or ``every`` < 1.
    """
    if every < 1:
        raise SystemExit(f"--every must be >= 1, got {every}")
    weights = teacher / "model.safetensors"
    if not (teacher / "config.json").is_file() or not weights.is_file():
        raise SystemExit(f"{teacher}: not a model directory with config.json and one model.safetensors")
    config = json.loads((teacher / "config.json").read_text())
    kept = list(range(0, config["num_hidden_layers"], every))
    renumber = {old: new for new, old in enumerate(kept)}
    tensors = {}
    for name, value in load_file(str(weights)).items():
        m = LAYER.match(name)
        if m is None:
            tensors[name] = value
        elif int(m.group(1)) in renumber:
            tensors[f"model.layers.{renumber[int(m.group(1))]}.{m.group(2)}"] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = len(kept)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in teacher.iterdir():  # tokenizer, chat template, generation settings
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, out / path.name)
    return len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher", type=Path, help="the teacher's model directory")
    parser.add_argument("out", type=Path, help="the student's model directory (created)")
    parser.add_argument("--every", type=int, default=2,
                        help="keep every this many-th layer (default 2: half the layers)")
    args = parser.parse_args()
    n = make_student(args.teacher, args.out, args.every)
    print(f"student of {n} layers -> {args.out}")


if __name__ == "__main__":
    main()
