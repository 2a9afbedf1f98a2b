"""SkyPilot's task YAML and Kubeflow Trainer's manifests (examples/skypilot/, examples/kubeflow/; issue 47):
each passes its validator, and each runs the multi-machine command docs/multi-node.md shows.

SkyPilot itself cannot be installed beside the test extra (skypilot 0.14.1 requires click<8.2; huggingface_hub
and wandb require click>=8.2 and >=8.4.2), so its YAML is checked against SkyPilot 0.14.1's own JSON schemas,
dumped once from that version's ``sky.utils.schemas`` (task, resources, storage) into
tests/fixtures/skypilot-0.14.1-schemas.json. ``sky.Task.from_yaml`` in a separate venv accepted the same file.
The Kubeflow manifests are read by the Trainer's API models (``kubeflow-trainer-api``, pydantic) and must
come back unchanged from them: a key the API does not have is dropped by the models and fails the comparison.
"""

from __future__ import annotations

import copy
import json
import re
import shlex

import jsonschema
import pytest
import yaml
from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

from conftest import ROOT

SKYPILOT = ROOT / "examples" / "skypilot" / "shardlm.yaml"
RUNTIME = ROOT / "examples" / "kubeflow" / "shardlm-runtime.yaml"
TRAINJOB = ROOT / "examples" / "kubeflow" / "trainjob.yaml"
SCHEMAS = json.loads((ROOT / "tests" / "fixtures" / "skypilot-0.14.1-schemas.json").read_text())
#: node 0 of docs/multi-node.md's two-node example
NODE0 = {"nnodes": "2", "node_rank": "0", "master_addr": "10.0.0.1", "master_port": "29500", "gpus": "8"}


def docs_command() -> list[str]:
    """docs/multi-node.md's multi-machine command, node 0's line of its static-rendezvous example, as argv."""
    text = (ROOT / "docs" / "multi-node.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith("torchrun --nnodes=2 --node-rank=0 ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def torchrun_line(script: str) -> str:
    """The one line of a shell script (continuations joined) that starts torchrun."""
    lines = [line.strip() for line in script.replace("\\\n", " ").splitlines()
             if line.strip().startswith("torchrun")]
    assert len(lines) == 1, script
    return lines[0]


def case_insensitive_enum(validator, allowed, value, schema):
    """SkyPilot's own schema keyword (its loader adds it to the JSON-schema validator): a string that equals
    one of ``allowed`` but for case."""
    if isinstance(value, str) and value.lower() not in {a.lower() for a in allowed}:
        yield jsonschema.ValidationError(f"{value!r} is not one of {allowed} (case-insensitive)")


Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                         {"case_insensitive_enum": case_insensitive_enum})


def skypilot_errors(task: dict) -> list[str]:
    """SkyPilot's schema errors for ``task``: the task, its resources, its storage mounts (as SkyPilot checks
    each with its own schema; its ``case_insensitive_enum`` keyword included)."""
    checks = [(task, SCHEMAS["task"]), (task.get("resources", {}), SCHEMAS["resources"])]
    mounts = (task.get("file_mounts") or {}).values()
    checks += [(m, SCHEMAS["storage"]) for m in mounts if isinstance(m, dict)]
    return [e.message for doc, schema in checks for e in Validator(schema).iter_errors(doc)]


def test_the_skypilot_yaml_passes_skypilots_schemas_and_a_broken_one_does_not():
    task = yaml.safe_load(SKYPILOT.read_text())
    assert skypilot_errors(task) == []
    broken = copy.deepcopy(task)
    broken["num_node"] = broken.pop("num_nodes")
    broken["resources"]["job_recovery"]["max_restarts_on_errors"] = -1
    broken["file_mounts"]["/runs"]["mode"] = "mount it"
    assert len(skypilot_errors(broken)) == 3, skypilot_errors(broken)


def test_the_skypilot_yaml_runs_the_docs_multi_machine_command_with_skypilots_node_variables():
    task = yaml.safe_load(SKYPILOT.read_text())
    assert task["num_nodes"] == int(NODE0["nnodes"])
    assert task["resources"]["accelerators"] == f"H100:{NODE0['gpus']}"
    assert task["envs"]["MASTER_PORT"] == NODE0["master_port"]
    # node 0's address is the first of SkyPilot's node IPs (one per line, the head node first)
    assert 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)' in task["run"]
    values = {**{k: str(v) for k, v in task["envs"].items()}, "SKYPILOT_NUM_NODES": NODE0["nnodes"],
              "SKYPILOT_NODE_RANK": NODE0["node_rank"], "MASTER_ADDR": NODE0["master_addr"],
              "SKYPILOT_NUM_GPUS_PER_NODE": NODE0["gpus"]}
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], torchrun_line(task["run"]))
    assert shlex.split(line) == [*docs_command(), f"--run.dir={task['envs']['RUN_DIR']}", "--resume=auto"]


@pytest.mark.parametrize("path, model", [(RUNTIME, TrainerV1alpha1ClusterTrainingRuntime),
                                         (TRAINJOB, TrainerV1alpha1TrainJob)])
def test_the_kubeflow_manifests_are_what_the_trainer_api_models_read_and_a_misspelled_key_is_not(path, model):
    manifest = yaml.safe_load(path.read_text())
    assert model.from_dict(manifest).to_dict() == manifest
    broken = copy.deepcopy(manifest)
    spec = broken["spec"]
    spec["mlPolicy" if "mlPolicy" in spec else "trainer"]["numNode"] = 2
    assert model.from_dict(broken).to_dict() != broken


def test_the_kubeflow_trainjob_runs_the_docs_multi_machine_command_with_the_pet_variables():
    runtime, job = yaml.safe_load(RUNTIME.read_text()), yaml.safe_load(TRAINJOB.read_text())
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    assert replicated["name"] == container["name"] == "node"  # the container the PET_* variables go to
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (int(NODE0["nnodes"]), int(NODE0["gpus"]))
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == int(NODE0["gpus"])
    # what the torch plugin sets on node 0 (PET_NODE_RANK is the Job's completion index)
    pet = {"PET_NNODES": NODE0["nnodes"], "PET_NODE_RANK": NODE0["node_rank"],
           "PET_MASTER_ADDR": NODE0["master_addr"], "PET_MASTER_PORT": NODE0["master_port"],
           "PET_NPROC_PER_NODE": NODE0["gpus"]}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: pet[m.group(1)], a)
            for a in container["command"] + trainer["args"]]
    assert argv == [*docs_command(), "--run.dir=/runs/llama3-8b", "--resume=auto"]
    assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
