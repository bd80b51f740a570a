"""Kubernetes manifests checked against the schemas of their APIs, as an API server would.

- Built-in kinds (Job, StatefulSet, Service, PriorityClass, ...): the API's own OpenAPI
  schemas as `kubernetes-validate` ships them, strict (a field the API does not know is an
  error), for the oldest Kubernetes the examples claim (1.29: podFailurePolicy rules
  without onPodConditions) and the newest the package knows.
- The two custom resources, against their projects' published models (no package ships
  their CRDs' schemas): PyTorchJob (kubeflow.org/v1) against the training operator's SDK,
  `kubeflow-training` (classes of the OpenAPI generator, naming each field's JSON key
  and type); JobSet (jobset.x-k8s.io/v1alpha2) against `kubeflow-trainer-api`, which
  publishes JobSet's models (pydantic) because Kubeflow Trainer embeds JobSets. Every
  field must be one the model names, with the model's type, and (JobSet) every required
  field given. The parts of Kubernetes' own types in them (the pod and Job templates,
  the autoscaler's metrics, the metadata) go to kubernetes-validate, in a resource of
  their kind. A few fields the models type as plain strings take only the values the
  APIs document (`ENUMS`): the PyTorchJob API's constants, and for JobSet the values
  its models' own field descriptions list.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pydantic

#: the oldest the examples claim (training-job.yaml), and the newest the package knows
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
#: (model, JSON key): the values the API documents for a field its model types as a string
ENUMS: dict[tuple[str, str], frozenset[str]] = {
    ("KubeflowOrgV1ElasticPolicy", "rdzvBackend"): frozenset({"c10d", "etcd", "etcd-v2"}),
    ("KubeflowOrgV1ReplicaSpec", "restartPolicy"): frozenset({"Always", "OnFailure", "Never", "ExitCode"}),
    ("JobsetV1alpha2FailurePolicyRule", "action"): frozenset({
        "FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
        "RestartJobAndIgnoreMaxRestarts",
    }),
    ("JobsetV1alpha2SuccessPolicy", "operator"): frozenset({"All", "Any"}),
    ("JobsetV1alpha2DependsOn", "status"): frozenset({"Ready", "Complete"}),
}
#: the keys of a PyTorchJob's pytorchReplicaSpecs
REPLICA_TYPES = frozenset({"Master", "Worker"})


class ManifestError(ValueError):
    """A manifest the API would refuse: where, and why."""


def validate(doc: dict[str, Any]) -> None:
    """Raise ManifestError unless `doc` matches its kind's schema."""
    kind = (doc.get("apiVersion"), doc.get("kind"))
    if kind == ("kubeflow.org/v1", "PyTorchJob"):
        _generator_model(doc, "KubeflowOrgV1PyTorchJob", "")
    elif kind == ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

        try:
            JobsetV1alpha2JobSet.from_dict(doc)  # the types, as the model checks them
        except pydantic.ValidationError as e:
            raise ManifestError(f"JobSet: {e}") from None
        _pydantic_model(doc, JobsetV1alpha2JobSet, "")
    else:
        _builtin(doc, str(doc.get("kind", "?")))


def _builtin(doc: dict[str, Any], where: str) -> None:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            raise ManifestError(f"{where}{'.' + path if path else ''} (Kubernetes {version}): {e.message}") from None
        except kubernetes_validate.SchemaNotFoundError as e:
            raise ManifestError(f"{where}: {e.message}") from None


#: Kubernetes' own types in the models (by the generators' names), each checked as part
#: of a resource of its kind
def _in_configmap(metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}


_KUBERNETES_PARTS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "V1ObjectMeta": _in_configmap,
    "IoK8sApimachineryPkgApisMetaV1ObjectMeta": _in_configmap,
    "V1PodTemplateSpec": lambda data: {
        "apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "template"}, "template": data,
    },
    "IoK8sApiBatchV1JobTemplateSpec": lambda data: {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job", **(data.get("metadata") or {})},
        "spec": data.get("spec"),
    },
    "K8sIoApiAutoscalingV2MetricSpec": lambda data: {  # autoscaling/v2's MetricSpec
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "hpa"},
        "spec": {"scaleTargetRef": {"kind": "PyTorchJob", "name": "job"}, "maxReplicas": 1, "metrics": [data]},
    },
}


def _kubernetes_part(type_name: str, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected a {type_name} mapping, got {data!r}")
    _builtin(_KUBERNETES_PARTS[type_name](data), f"{where} ({type_name})")


def _fields(data: Any, class_name: str, known: set[str], where: str) -> None:
    """The checks common to both kinds of models: a mapping, of known fields, enums."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where or class_name}: expected a {class_name} mapping, got {data!r}")
    for key, value in data.items():
        if key not in known:
            raise ManifestError(f"{_at(where, key)}: {class_name} has no field {key!r} (it has {sorted(known)})")
        allowed = ENUMS.get((class_name, key))
        if allowed is not None and value not in allowed:
            raise ManifestError(f"{_at(where, key)}: {value!r} is not one of {sorted(allowed)}")


def _at(where: str, key: str | int) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip(".")


# --- PyTorchJob: kubeflow-training's models (the OpenAPI generator's classes) -------------

_PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (float, int)}


def _generator_type(data: Any, type_name: str, where: str) -> None:
    """`data` (a manifest's value at `where`) against a generator type: `list[T]`,
    `dict(str, T)`, a primitive, a Kubernetes type or a model."""
    if items := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(data, list):
            raise ManifestError(f"{where}: expected a list, got {data!r}")
        for i, item in enumerate(data):
            _generator_type(item, items.group(1), _at(where, i))
    elif values := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a mapping, got {data!r}")
        for key, value in data.items():
            _generator_type(value, values.group(1), _at(where, key))
    elif type_name in _PRIMITIVES:
        if not isinstance(data, _PRIMITIVES[type_name]) or (type_name != "bool" and isinstance(data, bool)):
            raise ManifestError(f"{where}: expected {type_name}, got {data!r}")
    elif type_name in _KUBERNETES_PARTS:
        _kubernetes_part(type_name, data, where)
    else:
        _generator_model(data, type_name, where)


def _generator_model(data: Any, class_name: str, where: str) -> None:
    from kubeflow.training import models

    cls = getattr(models, class_name, None)
    if cls is None or not class_name.startswith("KubeflowOrgV1"):
        raise ManifestError(f"{where or class_name}: no schema for {class_name}")
    attributes = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    _fields(data, class_name, set(attributes), where)
    for key, value in data.items():
        _generator_type(value, cls.openapi_types[attributes[key]], _at(where, key))
    if class_name == "KubeflowOrgV1PyTorchJobSpec":
        unknown = set(data.get("pytorchReplicaSpecs") or {}) - REPLICA_TYPES
        if unknown:
            raise ManifestError(f"{_at(where, 'pytorchReplicaSpecs')}: unknown replica types {sorted(unknown)}")


# --- JobSet: kubeflow-trainer-api's models (pydantic) ------------------------------------


def _pydantic_model(data: Any, cls: type[pydantic.BaseModel], where: str) -> None:
    """Known and required fields of a model and the models inside it (the types were
    checked by the model's own validation)."""
    fields = {field.alias or name: field for name, field in cls.model_fields.items()}
    _fields(data, cls.__name__, set(fields), where)
    missing = sorted(key for key, field in fields.items() if field.is_required() and key not in data)
    if missing:
        raise ManifestError(f"{where or cls.__name__}: {cls.__name__} needs {missing}")
    for key, value in data.items():
        shape, inner = _shape(fields[key].annotation)
        if inner is None:
            continue
        items = value.items() if shape == "dict" else enumerate(value) if shape == "list" else [(None, value)]
        for index, item in items:
            at = _at(where, key) if index is None else _at(_at(where, key), index)
            if inner.__name__ in _KUBERNETES_PARTS:
                _kubernetes_part(inner.__name__, item, at)
            else:
                _pydantic_model(item, inner, at)


def _shape(annotation: Any) -> tuple[str, type[pydantic.BaseModel] | None]:
    """("one" | "list" | "dict", the model it holds, if any) of a field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return _shape(args[0])
    if origin is list:
        return "list", _shape(args[0])[1]
    if origin is dict:
        return "dict", _shape(args[1])[1]
    model = annotation if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) else None
    return "one", model
