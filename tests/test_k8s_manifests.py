"""Every manifest in examples/kubernetes matches its API's schema, as an API server would
check it (tests/support/k8s_schemas.py: kubernetes-validate for built-in kinds, the projects'
published models for PyTorchJob and JobSet), and the check catches the mistakes it is
there for. The `elasticrun` command lines in the same manifests are parsed by the CLI in
tests/test_examples.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.support.k8s_schemas import ManifestError, validate

yaml = pytest.importorskip("yaml")

K8S = Path(__file__).resolve().parents[1] / "examples" / "kubernetes"
DELETE = object()


def manifests() -> list[tuple[str, int, dict[str, Any]]]:
    """(file, position in it, document) of every manifest in examples/kubernetes."""
    return [
        (path.name, i, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    ]


def document(name: str, kind: str) -> dict[str, Any]:
    return next(copy.deepcopy(doc) for file, _, doc in manifests() if file == name and doc["kind"] == kind)


def changed(doc: dict[str, Any], path: list[str | int], value: object) -> dict[str, Any]:
    """A copy of `doc` with the value at `path` set to `value` (or deleted)."""
    doc = copy.deepcopy(doc)
    parent: Any = doc
    for step in path[:-1]:
        parent = parent[step]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@pytest.mark.parametrize(("name", "index", "doc"), manifests(), ids=lambda v: v if isinstance(v, str) else None)
def test_the_manifest_matches_its_api_schema(name: str, index: int, doc: dict[str, Any]) -> None:
    validate(doc)


def test_the_examples_run_the_training_as_a_job_a_pytorchjob_and_a_jobset() -> None:
    kinds = {(file, doc["kind"]) for file, _, doc in manifests()}
    assert {("training-job.yaml", "Job"), ("pytorchjob-elastic.yaml", "PyTorchJob"), ("jobset.yaml", "JobSet")} <= kinds


_TRAINER: list[str | int] = ["spec", "template", "spec", "containers", 0]
_WORKER: list[str | int] = ["spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0]
_ELASTIC: list[str | int] = ["spec", "elasticPolicy"]
_TRAINERS: list[str | int] = ["spec", "replicatedJobs", 1]

MISTAKES: list[tuple[str, str, list[str | int], object, str]] = [
    # (file, kind, where, the wrong value, what the error says)
    ("training-job.yaml", "Job", ["spec", "paralellism"], 4, "'paralellism' was unexpected"),
    ("training-job.yaml", "Job", ["spec", "parallelism"], "four", "is not of type 'integer'"),
    ("training-job.yaml", "Job", [*_TRAINER, "args"], "--nnodes=2:8", "is not of type 'array'"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", [*_ELASTIC, "minReplica"], 2, "has no field 'minReplica'"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", [*_ELASTIC, "maxReplicas"], "8", "expected int"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", [*_ELASTIC, "rdzvBackend"], "zookeeper", "is not one of"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", [*_ELASTIC, "metrics", 0, "resource", "targetAverage"], 80,
     "'targetAverage' was unexpected"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", ["spec", "pytorchReplicaSpecs", "Trainer"], {}, "unknown replica types"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", ["spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"], "Sometimes",
     "is not one of"),
    ("pytorchjob-elastic.yaml", "PyTorchJob", [*_WORKER, "command"], "python -m elasticrun", "is not of type 'array'"),
    ("jobset.yaml", "JobSet", [*_TRAINERS, "replica"], 1, "has no field 'replica'"),
    ("jobset.yaml", "JobSet", [*_TRAINERS, "name"], DELETE, "needs ['name']"),
    ("jobset.yaml", "JobSet", ["spec", "failurePolicy", "maxRestarts"], "3", "valid integer"),
    ("jobset.yaml", "JobSet", ["spec", "successPolicy", "operator"], "Most", "is not one of"),
    ("jobset.yaml", "JobSet", [*_TRAINERS, "template", "spec", "completions"], "4", "valid integer"),
    ("jobset.yaml", "JobSet", [*_TRAINERS, "template", "spec", "template", "spec", "containers", 0, "imagePull"],
     "Always", "'imagePull' was unexpected"),
]


@pytest.mark.parametrize(("name", "kind", "path", "value", "says"), MISTAKES,
                         ids=[f"{m[1]}-{'.'.join(map(str, m[2][-2:]))}" for m in MISTAKES])
def test_the_schema_check_rejects_a_mistake(name: str, kind: str, path: list[str | int], value: object,
                                            says: str) -> None:
    wrong = changed(document(name, kind), path, value)
    with pytest.raises(ManifestError) as caught:
        validate(wrong)
    assert says in str(caught.value), caught.value
