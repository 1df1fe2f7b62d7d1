"""Schema checks of Kubernetes manifests from the API models of the kubernetes and kserve
Python SDKs (kubeconform's job, with what installs from PyPI).

Core kinds (PersistentVolumeClaim, ...) and every core type inside a KServe resource (Container,
Probe, Volume, ResourceRequirements, ...) are checked by the kubernetes client's pydantic
models, which forbid unknown fields and check types and required fields. The KServe kinds
(ServingRuntime, InferenceService) are walked through the kserve SDK's OpenAPI models: every
key must be a field of its model (camelCase, as in the CRD), every value of the field's type,
and each model is then built, which runs the SDK's own required-field and enum checks.

    python tests/deploy/k8s_schema.py deploy/kserve/*.yaml     # prints the errors, exit 1
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

KSERVE_KINDS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}
CORE_KINDS = {
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
}

_LIST = re.compile(r"list\[(.+)\]")
_DICT = re.compile(r"dict\(str, (.+)\)")


def _kserve_model(name: str) -> Any | None:
    import kserve.models

    return getattr(kserve.models, name, None)


def _core_model(name: str) -> Any | None:
    import kubernetes.client

    return getattr(kubernetes.client, name, None)


def _check_core(value: Any, cls: Any, path: str, errors: list[str]) -> None:
    from pydantic import ValidationError

    try:
        cls.model_validate(value)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            errors.append(f"{path}.{loc}: {err['msg']}" if loc else f"{path}: {err['msg']}")


def _check(value: Any, typ: str, path: str, errors: list[str]) -> Any:
    """Check `value` against the OpenAPI type name `typ`; returns a value to build with."""
    if (m := _LIST.fullmatch(typ)) is not None:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return None
        return [_check(v, m.group(1), f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if (m := _DICT.fullmatch(typ)) is not None:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return None
        return {k: _check(v, m.group(1), f"{path}.{k}", errors) for k, v in value.items()}
    simple = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
    if typ in simple:
        ok = isinstance(value, simple[typ]) and not (typ != "bool" and isinstance(value, bool))
        if not ok:
            errors.append(f"{path}: expected {typ}, got {type(value).__name__} {value!r}")
        return value
    if typ in ("object", "datetime", "date"):
        return value
    model = _kserve_model(typ)
    if model is not None:
        return _check_kserve(value, model, path, errors)
    core = _core_model(typ)
    if core is not None:
        _check_core(value, core, path, errors)
        return value
    errors.append(f"{path}: unknown schema type {typ!r}")
    return None


def _check_kserve(value: Any, model: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a {model.__name__} mapping, got {type(value).__name__}")
        return None
    by_key = {key: attr for attr, key in model.attribute_map.items()}
    kwargs: dict[str, Any] = {}
    for key, v in value.items():
        attr = by_key.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: unknown field of {model.__name__} (known: "
                          f"{', '.join(sorted(by_key))})")
            continue
        kwargs[attr] = _check(v, model.openapi_types[attr], f"{path}.{key}", errors)
    try:  # the SDK's own setters: required fields (not None), enums
        model(**kwargs)
    except (ValueError, TypeError) as e:
        errors.append(f"{path}: {model.__name__}: {e}")
    return kwargs


def validate(doc: Any) -> list[str]:
    """Errors of one manifest document (empty = valid)."""
    if not isinstance(doc, dict):
        return [f"a manifest must be a mapping; got {type(doc).__name__}"]
    api, kind = doc.get("apiVersion"), doc.get("kind")
    name = (doc.get("metadata") or {}).get("name", "?")
    where = f"{kind}/{name}"
    if (api, kind) in KSERVE_KINDS:
        errors: list[str] = []
        model = _kserve_model(KSERVE_KINDS[(api, kind)])
        _check_kserve(doc, model, where, errors)
        if not (doc.get("metadata") or {}).get("name"):
            errors.append(f"{where}.metadata.name: required")
        return errors
    if (api, kind) in CORE_KINDS:
        errors = []
        _check_core(doc, _core_model(CORE_KINDS[(api, kind)]), where, errors)
        return errors
    return [f"{where}: no schema for apiVersion={api!r} kind={kind!r}"]


def load_all(paths: list[Path]) -> list[tuple[Path, Any]]:
    out = []
    for p in paths:
        for doc in yaml.safe_load_all(p.read_text()):
            if doc is not None:
                out.append((p, doc))
    return out


def main(argv: list[str]) -> int:
    bad = 0
    for path, doc in load_all([Path(a) for a in argv]):
        errors = validate(doc)
        for e in errors:
            print(f"{path}: {e}")
        bad += bool(errors)
        if not errors:
            print(f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')} valid")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
