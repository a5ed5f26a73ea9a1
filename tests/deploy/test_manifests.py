"""The Kubernetes manifests in ``deploy/``, checked offline: the base and every overlay render,
every object is valid for Kubernetes ``KUBERNETES_VERSION`` (the JSON schemas bundled with the
pinned ``kubernetes-validate``, strict: an unknown field is an error; the InferencePool against its
vendored CRD's schema, as strictly), and the objects agree with each other, with the commands they
run and with ``kvsite/settings.py``.

Nothing installable here renders Kustomize (Debian has no kustomize; on PyPI ``pykustomize``
needs Python 3.14, ``kustomize`` writes manifests from Python, ``pytest-kustomize`` runs the
binary), so ``render`` below builds the kustomizations itself, for the subset of Kustomize that
``deploy/`` uses and nothing more:

- ``resources``: YAML files (every document) and directories holding a kustomization;
- ``configMapGenerator`` with ``name`` and ``envs`` (``KEY=VALUE`` lines, ``#`` comments): the
  ConfigMap's name gets a hash of its content and the pod specs' references to it follow it
  (``envFrom``, ``configMapKeyRef``, ``configMap`` volumes), an overlay's own pod specs too. The
  suffix is 10 hex characters of a SHA-256, not kustomize's exact string: nothing here depends on
  the string;
- ``images`` with ``name``, ``newName``, ``newTag`` on pod templates' containers;
- ``patches`` with a ``path`` to one document that is a ``$patch: delete`` of one object.

Anything else (another field, a strategic merge that changes fields, a patch file of several
documents, which kustomize refuses too) raises ``Unsupported``: the renderer never guesses, so
what it renders is what kustomize renders, up to the hash suffix and the order of the objects.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import shlex
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.core.management import get_commands, load_command_class
from django.core.management.base import CommandError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = sorted(path.parent for path in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
ENGINE_EXAMPLE = DEPLOY / "examples" / "vllm-engine.yaml"
SECRETS_EXAMPLE = DEPLOY / "secrets.example.env"
INFERENCE_POOL_OVERLAY = DEPLOY / "overlays" / "inference-pool"
# Custom resources (apiVersion, kind) -> the CRD that defines them, vendored from their project.
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        INFERENCE_POOL_OVERLAY / "crd" / "inference.networking.k8s.io_inferencepools.yaml"
    ),
}

# The oldest Kubernetes minor the manifests claim (deploy/README.md); every field they use is GA
# there. kubernetes-validate bundles 1.25 to 1.37.
KUBERNETES_VERSION = "1.30.0"

# The Secret the manifests read and do not create: the operator makes it from the example file.
SECRET_NAME = "kvcache-secrets"

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job"}
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
EXPANSION = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# A manage.py command in a shell script, up to the shell's next operator or redirection.
SHELL_MANAGE_PY = re.compile(r"python manage\.py ([^;&|<>]+)")
# The commands the service runs, with the component that must run each (issue: deploy/).
COMMANDS = {"serve": "web", "ingest": "ingest", "gateway": "gateway", "migrate": "migrate", "epp": "epp"}
# The commands every render runs; the EPP runs where there is an InferencePool to pick endpoints of.
SERVICE_COMMANDS = {"serve", "ingest", "gateway", "migrate"}


# --- the renderer ------------------------------------------------------------------------------


class Unsupported(Exception):
    """A kustomization asks for more than ``render`` implements."""


def render(directory: Path) -> list[dict]:
    """The objects ``kustomize build directory`` would print (the subset in the module docstring)."""
    objects, _ = _render(directory)
    return objects


def _render(directory: Path) -> tuple[list[dict], dict[str, str]]:
    """The objects, and each generated ConfigMap's name -> its hashed name (the generators of the
    resources' kustomizations too: an overlay's pod specs refer to its base's ConfigMaps by name)."""
    kustomization = _one_document(directory / "kustomization.yaml")
    _only(kustomization, {"apiVersion", "kind", "resources", "configMapGenerator", "images", "patches"})
    objects: list[dict] = []
    renamed: dict[str, str] = {}
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            below, below_renamed = _render(path)
            objects += below
            renamed |= below_renamed
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for generator in kustomization.get("configMapGenerator", []):
        _only(generator, {"name", "envs"})
        data: dict[str, str] = {}
        for env_file in generator["envs"]:
            data.update(read_env_file(directory / env_file))
        digest = hashlib.sha256(json.dumps([generator["name"], data], sort_keys=True).encode()).hexdigest()
        renamed[generator["name"]] = f"{generator['name']}-{digest[:10]}"
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": renamed[generator["name"]]},
                "data": data,
            }
        )
    for spec in _pod_specs(objects):
        _rename_config_maps(spec, renamed)
    for image in kustomization.get("images", []):
        _only(image, {"name", "newName", "newTag"})
        for container in _containers(objects):
            name, tag = split_image(container["image"])
            if name == image["name"]:
                name, tag = image.get("newName", name), image.get("newTag", tag)
                container["image"] = name if tag is None else f"{name}:{tag}"
    for patch in kustomization.get("patches", []):
        _only(patch, {"path"})
        objects = _delete(objects, _one_document(directory / patch["path"]))
    ids = [object_id(obj) for obj in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"{directory}: objects defined twice: {duplicates}"
    return objects, renamed


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments skipped. A bare ``KEY`` (kustomize takes
    its value from the environment of whoever builds) and quoted values (kept literally, quotes
    and all, by kustomize) are refused: both are mistakes in a file of settings."""
    data = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.lstrip()  # as kustomize: a value keeps its trailing spaces
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        if not equals or value[:1] in {'"', "'"}:
            raise Unsupported(f"{path}:{number}: write KEY=VALUE, unquoted: {raw!r}")
        data[key] = value
    return data


def _one_document(path: Path) -> dict:
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    if len(documents) != 1:
        raise Unsupported(f"{path}: {len(documents)} documents where kustomize takes one")
    return documents[0]


def _only(mapping: dict, allowed: set[str]) -> None:
    if unknown := set(mapping) - allowed:
        raise Unsupported(f"not implemented by the test's renderer: {sorted(unknown)}")


def _delete(objects: list[dict], patch: dict) -> list[dict]:
    if patch.get("$patch") != "delete" or set(patch) != {"$patch", "apiVersion", "kind", "metadata"}:
        raise Unsupported(f"only whole-object deletions are implemented, not {patch}")
    target = object_id(patch)
    kept = [obj for obj in objects if object_id(obj) != target]
    if len(kept) != len(objects) - 1:
        raise Unsupported(f"the patch matches no object: {target}")  # kustomize fails too
    return kept


def _rename_config_maps(spec: dict, renamed: dict[str, str]) -> None:
    def rename(ref: dict | None) -> None:
        if ref and ref.get("name") in renamed:
            ref["name"] = renamed[ref["name"]]

    for container in spec.get("containers", []) + spec.get("initContainers", []):
        for source in container.get("envFrom", []):
            rename(source.get("configMapRef"))
        for var in container.get("env", []):
            rename(var.get("valueFrom", {}).get("configMapKeyRef"))
    for volume in spec.get("volumes", []):
        rename(volume.get("configMap"))
        for source in volume.get("projected", {}).get("sources", []):
            rename(source.get("configMap"))


# --- reading rendered objects -------------------------------------------------------------------


def object_id(obj: dict) -> tuple[str, str, str]:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def split_image(image: str) -> tuple[str, str | None]:
    """``(name, tag)``; a registry's port is not a tag. Digests are not used here."""
    if "@" in image:
        raise Unsupported(f"image digests are not implemented: {image}")
    name, colon, tag = image.rpartition(":")
    if not colon or "/" in tag:
        return image, None
    return name, tag


def workloads(objects: list[dict]) -> Iterator[dict]:
    return (obj for obj in objects if obj["kind"] in WORKLOAD_KINDS)


def _pod_specs(objects: list[dict]) -> Iterator[dict]:
    return (obj["spec"]["template"]["spec"] for obj in workloads(objects))


def _containers(objects: list[dict]) -> Iterator[dict]:
    for spec in _pod_specs(objects):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def match_labels(label_selector: dict) -> dict[str, str]:
    """A LabelSelector's ``matchLabels``; ``matchExpressions`` are not implemented here."""
    if "matchExpressions" in label_selector:
        raise Unsupported(f"matchExpressions are not checked: {label_selector}")
    return label_selector.get("matchLabels", {})


def has_port(workload: dict, port: str | int) -> bool:
    """Whether a container of the workload exposes ``port`` (a name, or a number)."""
    field = "name" if isinstance(port, str) else "containerPort"
    return any(
        declared.get(field) == port
        for container in workload["spec"]["template"]["spec"]["containers"]
        for declared in container.get("ports", [])
    )


def container_port(container: dict, name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == name), None)


def options(args: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` arguments as a mapping (flags map to "")."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, equals, value = arg[2:].partition("=")
            if not equals and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            out[name] = value
    return out


def manage_py_command(container: dict) -> list[str] | None:
    """The ``manage.py`` subcommand and its arguments a container runs directly, else None."""
    argv = container.get("command", []) + container.get("args", [])
    if argv[:2] == ["python", "manage.py"]:
        return argv[2:]
    return None


def settings_names() -> set[str]:
    """Every environment variable ``kvsite/settings.py`` reads: ``os.environ.get(NAME)``,
    ``os.environ[NAME]``, ``env_bool(NAME)``, ``env_list(NAME)``."""
    tree = ast.parse((ROOT / "kvsite" / "settings.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "get" and _is_os_environ(func.value)) or (
                isinstance(func, ast.Name) and func.id in {"env_bool", "env_list"}
            ):
                names.add(node.args[0].value)
        elif (
            isinstance(node, ast.Subscript)
            and _is_os_environ(node.value)
            and isinstance(node.slice, ast.Constant)
        ):
            names.add(node.slice.value)
    return names


def _is_os_environ(node: ast.expr) -> bool:
    return ast.unparse(node) == "os.environ"


def operator_secret() -> dict:
    """The Secret as ``kubectl create secret generic --from-env-file`` makes it from the example."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET_NAME},
        "type": "Opaque",
        "stringData": read_env_file(SECRETS_EXAMPLE),
    }


def app_image() -> str:
    """The service's image reference as the base's ``images`` entry sets it."""
    (entry,) = _one_document(BASE / "kustomization.yaml")["images"]
    return f"{entry['newName']}:{entry['newTag']}"


# --- the checks: each returns what is wrong, so that a test of it can show it failing ----------


@cache
def crd_schema(path: Path, version: str) -> dict:
    """The JSON schema of a CRD's ``version`` (its ``openAPIV3Schema``), made strict."""
    crd = _one_document(path)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict_schema(served["schema"]["openAPIV3Schema"])


def strict_schema(schema: object) -> object:
    """An OpenAPI v3 schema as a JSON schema, strict as ``kubernetes-validate``'s: an object whose
    properties it lists takes no other. The ``x-kubernetes-*`` extensions (list types, CEL rules)
    are the API server's and dropped; what their rules say is checked by the cross-checks."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {
        key: strict_schema(value) for key, value in schema.items() if not key.startswith("x-kubernetes-")
    }
    if "properties" in schema:
        # Keys under "properties" are field names, not keywords: a field may be named anything.
        strict["properties"] = {name: strict_schema(value) for name, value in schema["properties"].items()}
        strict.setdefault("additionalProperties", False)
    return strict


def custom_resource_problems(obj: dict) -> list[str]:
    """``obj`` against its vendored CRD's schema of its version (jsonschema, draft 2020-12 as
    ``kubernetes-validate``)."""
    path = CRDS[(obj["apiVersion"], obj["kind"])]
    schema = crd_schema(path, obj["apiVersion"].rpartition("/")[2])
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{object_id(obj)} at {'/'.join(str(part) for part in error.path) or '/'}: {error.message}"
        for error in validator.iter_errors(obj)
    ]


def schema_problems(objects: list[dict]) -> list[str]:
    problems = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            problems += custom_resource_problems(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(part) for part in error.path)
            problems.append(f"{object_id(obj)} at {path or '/'}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{object_id(obj)}: {error.message}")
    return problems


def workload_problems(objects: list[dict]) -> list[str]:
    """A Deployment's or StatefulSet's selector must select its own pods (the API server refuses
    one that does not; the schema cannot tell), and so must its spread constraints."""
    problems = []
    for workload in workloads(objects):
        labels = pod_labels(workload)
        selector = match_labels(workload["spec"].get("selector", {}))
        if workload["kind"] != "Job" and not selects(selector, labels):
            problems.append(f"{object_id(workload)}: selector {selector} misses its pods {labels}")
        for constraint in workload["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            if not selects(match_labels(constraint["labelSelector"]), labels):
                problems.append(f"{object_id(workload)}: a spread constraint misses its own pods")
    return problems


def selector_problems(objects: list[dict]) -> list[str]:
    """Every Service, PodDisruptionBudget and NetworkPolicy selects pods of this render, and every
    port a Service or NetworkPolicy names is a container port of every pod it selects."""
    problems = []
    pods = list(workloads(objects))

    def selected(selector: dict | None) -> list[dict]:
        return [w for w in pods if selects(selector, pod_labels(w))]

    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Service":
            targets = selected(obj["spec"].get("selector"))
            ports = [port.get("targetPort", port["port"]) for port in obj["spec"]["ports"]]
        elif kind == "PodDisruptionBudget":
            targets, ports = selected(match_labels(obj["spec"]["selector"])), []
        elif kind == "NetworkPolicy":
            targets = selected(match_labels(obj["spec"]["podSelector"]))
            ports = [port["port"] for rule in obj["spec"].get("ingress", []) for port in rule["ports"]]
            for rule in obj["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    if not selected(match_labels(peer["podSelector"])):
                        problems.append(f"{kind} {name}: admits pods of no workload here")
        else:
            continue
        if not targets:
            problems.append(f"{kind} {name}: selects the pods of no workload")
        for target in targets:
            problems += [
                f"{kind} {name}: port {port!r} is no container port of {object_id(target)}"
                for port in ports
                if not has_port(target, port)
            ]
    return problems


def probe_problems(objects: list[dict]) -> list[str]:
    """Every probe's port is a port its container declares (by name, or by number)."""
    problems = []
    for container in _containers(objects):
        names = {p.get("name") for p in container.get("ports", [])}
        numbers = {p["containerPort"] for p in container.get("ports", [])}
        for probe in PROBES:
            for handler in ("httpGet", "tcpSocket", "grpc"):
                port = container.get(probe, {}).get(handler, {}).get("port")
                if port is not None and port not in (names if isinstance(port, str) else numbers):
                    problems.append(f"container {container['name']}: {probe} on undeclared port {port!r}")
    return problems


def reference_problems(objects: list[dict], secrets: list[dict]) -> list[str]:
    """Every ConfigMap and Secret a container reads exists, with every key it reads."""
    data = {}
    for obj in objects + secrets:
        if obj["kind"] in {"ConfigMap", "Secret"}:
            keys = set(obj.get("data", {})) | set(obj.get("stringData", {}))
            data[(obj["kind"], obj["metadata"]["name"])] = keys
    problems = []

    def need(kind: str, ref: dict, key: str | None = None) -> None:
        keys = data.get((kind, ref["name"]))
        if keys is None:
            problems.append(f"{kind} {ref['name']} does not exist")
        elif key is not None and key not in keys:
            problems.append(f"{kind} {ref['name']} has no key {key}")

    for container in _containers(objects):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                need("ConfigMap", source["configMapRef"])
            if "secretRef" in source:
                need("Secret", source["secretRef"])
        for var in container.get("env", []):
            value_from = var.get("valueFrom", {})
            if ref := value_from.get("configMapKeyRef"):
                need("ConfigMap", ref, ref["key"])
            if ref := value_from.get("secretKeyRef"):
                need("Secret", ref, ref["key"])
    return problems


def env_name_problems(objects: list[dict], secrets: list[dict], settings: set[str]) -> list[str]:
    """Every variable the service's containers get is a setting of kvsite/settings.py: a typo
    would be ignored silently, the setting left at its default. Variables only there to be
    expanded into another's value (``$(POD_IP)`` from the Downward API) are the exception."""
    config_maps = {obj["metadata"]["name"]: obj for obj in objects + secrets if obj["kind"] == "ConfigMap"}
    secret_objects = {obj["metadata"]["name"]: obj for obj in objects + secrets if obj["kind"] == "Secret"}
    problems = []
    for container in _containers(objects):
        if container["image"] != app_image():
            continue
        names = {var["name"] for var in container.get("env", [])} - set(expansions(container))
        for source in container.get("envFrom", []):
            if ref := source.get("configMapRef"):
                names |= set(config_maps.get(ref["name"], {}).get("data", {}))
            if ref := source.get("secretRef"):
                names |= set(secret_objects.get(ref["name"], {}).get("stringData", {}))
        problems += [f"container {container['name']}: {name} is no setting" for name in names - settings]
    return problems


def expansions(container: dict, *, env: bool = True) -> list[str]:
    """The ``$(NAME)`` references in a container's command and args (and its env values)."""
    texts = container.get("command", []) + container.get("args", [])
    if env:
        texts += [var["value"] for var in container.get("env", []) if "value" in var]
    return [name for text in texts for name in EXPANSION.findall(text)]


def expansion_problems(objects: list[dict]) -> list[str]:
    """Every ``$(NAME)`` names a variable defined before it in the container's env: Kubernetes
    leaves any other reference as it is, silently."""
    problems = []
    for container in _containers(objects):
        env = [var["name"] for var in container.get("env", [])]
        for var in container.get("env", []):
            for name in EXPANSION.findall(var.get("value", "")):
                if name not in env[: env.index(var["name"])]:
                    problems.append(f"container {container['name']}: {var['name']} uses $({name}) before it")
        for name in expansions(container, env=False):
            if name not in env:
                problems.append(f"container {container['name']}: $({name}) is not defined")
    return problems


def image_problems(objects: list[dict]) -> list[str]:
    """Every container that runs ``manage.py`` runs the one image of the base's ``images`` entry,
    and every image names a tag (never ``latest``): a rollout is a change of tag."""
    problems = []
    for container in _containers(objects):
        _, tag = split_image(container["image"])
        if tag in {None, "latest"}:
            problems.append(f"container {container['name']}: image {container['image']} has no fixed tag")
        argv = " ".join(container.get("command", []) + container.get("args", []))
        if "manage.py" in argv and container["image"] != app_image():
            problems.append(f"container {container['name']}: {container['image']}, not {app_image()}")
    return problems


def command_problems(objects: list[dict]) -> list[str]:
    """Each of the service's commands runs once, in its component, with arguments its own parser
    accepts, listening on the ports its container declares (and on every interface)."""
    problems = []
    seen = []
    for workload in workloads(objects):
        component = pod_labels(workload).get("app.kubernetes.io/component")
        for container in workload["spec"]["template"]["spec"]["containers"]:
            argv = manage_py_command(container)
            if argv is None:
                continue
            name, args = argv[0], argv[1:]
            seen.append(name)
            if COMMANDS.get(name) != component:
                problems.append(f"{object_id(workload)} ({component}) runs manage.py {name}")
                continue
            problems += parse_problems(name, args)
            given = options(args)
            if name in {"serve", "gateway"}:
                if given.get("host") != "0.0.0.0":
                    problems.append(f"manage.py {name} listens on {given.get('host')}, not every interface")
                if given.get("port") != str(container_port(container, "http")):
                    problems.append(f"manage.py {name} --port={given.get('port')}: the http port differs")
            if name == "epp":
                if given.get("host") != "0.0.0.0":
                    problems.append(f"manage.py epp listens on {given.get('host')}, not every interface")
                for option, port in (("grpc-port", "grpc"), ("metrics-port", "metrics")):
                    if given.get(option) != str(container_port(container, port)):
                        problems.append(
                            f"manage.py epp --{option}={given.get(option)}: the {port} port differs"
                        )
            if name == "ingest":
                if given.get("bind") != f"tcp://*:{container_port(container, 'zmq')}":
                    problems.append(f"manage.py ingest --bind={given.get('bind')}: the zmq port differs")
                if given.get("metrics-port") != str(container_port(container, "metrics")):
                    problems.append("manage.py ingest --metrics-port: the metrics port differs")
    expected = SERVICE_COMMANDS | ({"epp"} if inference_pools(objects) else set())
    if sorted(seen) != sorted(expected):
        problems.append(f"commands run: {sorted(seen)}, expected each of {sorted(expected)} once")
    for container in _containers(objects):
        if container.get("command", [])[:2] == ["sh", "-c"]:
            for line in SHELL_MANAGE_PY.findall(container["command"][2]):
                name, *args = shlex.split(line)
                problems += parse_problems(name, args)
    return problems


def parse_problems(name: str, args: list[str]) -> list[str]:
    """What ``manage.py name args`` would refuse, asked of the command's own parser."""
    if name not in get_commands():
        return [f"manage.py has no command {name}"]
    parser = load_command_class(get_commands()[name], name).create_parser("manage.py", name)
    try:
        parser.parse_args(args)
    except CommandError as error:
        return [f"manage.py {name} {shlex.join(args)}: {error}"]
    return []


def inference_pools(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == "InferencePool"]


def inference_pool_problems(objects: list[dict]) -> list[str]:
    """Each InferencePool selects the engine example's pods on their HTTP port and names the EPP's
    Service and its gRPC port; the EPP reads that pool, in its own namespace, serving the engines'
    model; its ServiceAccount may read the pool and list and watch pods (and nothing more)."""
    problems = []
    engine = _one_document(ENGINE_EXAMPLE)
    (engine_container,) = engine["spec"]["template"]["spec"]["containers"]
    epps = [
        (workload, container)
        for workload in workloads(objects)
        for container in workload["spec"]["template"]["spec"]["containers"]
        if (manage_py_command(container) or [None])[0] == "epp"
    ]
    for pool in inference_pools(objects):
        name, spec = pool["metadata"]["name"], pool["spec"]
        if not selects(match_labels(spec["selector"]), pod_labels(engine)):
            problems.append(f"InferencePool {name}: its selector misses the engine example's pods")
        if spec["targetPorts"][0]["number"] != container_port(engine_container, "http"):
            problems.append(f"InferencePool {name}: targetPorts[0] is not the engines' http port")
        ref = spec["endpointPickerRef"]
        if ref.get("kind", "Service") != "Service" or ref.get("group", "") != "":
            problems.append(f"InferencePool {name}: its endpoint picker is no Service")
        service = next(
            (o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == ref["name"]), None
        )
        if service is None:
            problems.append(f"InferencePool {name}: no Service {ref['name']} for its endpoint picker")
            continue
        port = next(
            (p for p in service["spec"]["ports"] if p["port"] == ref.get("port", {}).get("number")), None
        )
        if port is None or port.get("appProtocol") != "http2":
            problems.append(
                f"InferencePool {name}: Service {ref['name']} has no http2 port {ref.get('port')}"
            )
        readers = [
            (workload, container)
            for workload, container in epps
            if selects(service["spec"].get("selector"), pod_labels(workload))
            and port is not None
            and has_port(workload, port.get("targetPort", port["port"]))
        ]
        if not readers:
            problems.append(f"InferencePool {name}: Service {ref['name']} selects no EPP on that port")
        for workload, container in readers:
            given = options(manage_py_command(container))
            if given.get("pool-name") != name:
                problems.append(f"{object_id(workload)} reads pool {given.get('pool-name')}, not {name}")
            env = {var["name"]: var for var in container.get("env", [])}
            namespace = env.get("POD_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {})
            if given.get("pool-namespace") != "$(POD_NAMESPACE)" or namespace.get("fieldPath") != (
                "metadata.namespace"
            ):
                problems.append(f"{object_id(workload)} reads a pool outside its own namespace")
            if given.get("pool-model") != engine_container["args"][0]:
                problems.append(f"{object_id(workload)} --pool-model is not the engines' model")
            problems += rbac_problems(objects, workload)
    return problems


# What the EPP reads of the API: (API group, resource) -> the verbs it needs.
EPP_ACCESS = {("inference.networking.k8s.io", "inferencepools"): {"get"}, ("", "pods"): {"list", "watch"}}


def rbac_problems(objects: list[dict], workload: dict) -> list[str]:
    """The workload's ServiceAccount is bound to Roles that grant ``EPP_ACCESS``, exactly."""
    account = workload["spec"]["template"]["spec"].get("serviceAccountName", "default")
    if not any(o["kind"] == "ServiceAccount" and o["metadata"]["name"] == account for o in objects):
        return [f"{object_id(workload)}: ServiceAccount {account} does not exist"]
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Role"}
    granted: dict[tuple[str, str], set[str]] = {}
    for binding in (o for o in objects if o["kind"] == "RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        role = roles.get(binding["roleRef"]["name"]) if binding["roleRef"]["kind"] == "Role" else None
        if role is None:
            return [f"RoleBinding {binding['metadata']['name']}: no Role {binding['roleRef']['name']}"]
        for rule in role["rules"]:
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    if granted != EPP_ACCESS:
        return [f"{object_id(workload)}: its ServiceAccount is granted {granted}, not {EPP_ACCESS}"]
    return []


def all_problems(objects: list[dict]) -> list[str]:
    secrets = [operator_secret()]
    return (
        schema_problems(objects)
        + workload_problems(objects)
        + selector_problems(objects)
        + probe_problems(objects)
        + reference_problems(objects, secrets)
        + env_name_problems(objects, secrets, settings_names())
        + expansion_problems(objects)
        + image_problems(objects)
        + command_problems(objects)
        + inference_pool_problems(objects)
    )


# --- the manifests --------------------------------------------------------------------------------

RENDERS = [BASE, *OVERLAYS]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(BASE)


def test_there_is_an_overlay_for_an_external_redis() -> None:
    assert DEPLOY / "overlays" / "external-redis" in OVERLAYS


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_every_object_is_valid_for_kubernetes(directory: Path) -> None:
    assert schema_problems(render(directory)) == []


def test_the_operator_secret_and_the_engine_example_are_valid_for_kubernetes() -> None:
    engine = _one_document(ENGINE_EXAMPLE)
    assert schema_problems([operator_secret(), engine]) == []
    assert expansion_problems([engine]) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_workloads_select_their_own_pods(directory: Path) -> None:
    assert workload_problems(render(directory)) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_services_budgets_and_policies_select_pods_that_have_their_ports(directory: Path) -> None:
    assert selector_problems(render(directory)) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_probes_use_declared_ports(directory: Path) -> None:
    assert probe_problems(render(directory)) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_every_config_map_and_secret_key_read_exists(directory: Path) -> None:
    assert reference_problems(render(directory), [operator_secret()]) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_every_variable_set_is_a_setting(directory: Path) -> None:
    assert env_name_problems(render(directory), [operator_secret()], settings_names()) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_every_expanded_variable_is_defined_before(directory: Path) -> None:
    assert expansion_problems(render(directory)) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_the_service_runs_one_pinned_image(directory: Path) -> None:
    assert image_problems(render(directory)) == []


@pytest.mark.parametrize("directory", RENDERS, ids=lambda path: path.name)
def test_each_command_runs_with_valid_arguments_on_its_declared_ports(directory: Path) -> None:
    assert command_problems(render(directory)) == []


def test_the_settings_parser_finds_the_settings() -> None:
    names = settings_names()
    assert {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "KVCACHE_VAR_DIR", "DEBUG", "ALLOWED_HOSTS"} <= names
    assert {"KVCACHE_API_KEYS", "KVCACHE_REPLAY_PORT_OFFSET", "PYTHONHASHSEED"} <= names


def test_the_secret_holds_the_secrets_and_the_config_map_the_rest(base: list[dict]) -> None:
    (config_map,) = [obj for obj in base if obj["kind"] == "ConfigMap"]
    secret_keys = set(operator_secret()["stringData"])
    assert secret_keys == {"SECRET_KEY", "DATABASE_URL", "REDIS_URL"}
    assert not secret_keys & set(config_map["data"])
    assert set(config_map["data"]) <= settings_names()


def test_the_database_is_postgresql_shared_by_every_process() -> None:
    # SQLite on a volume cannot be shared by web, ingest and gateway pods on several nodes.
    assert urlsplit(operator_secret()["stringData"]["DATABASE_URL"]).scheme in {"postgres", "postgresql"}


def test_the_base_index_url_names_its_valkey_service(base: list[dict]) -> None:
    url = urlsplit(operator_secret()["stringData"]["REDIS_URL"])
    services = {obj["metadata"]["name"]: obj for obj in base if obj["kind"] == "Service"}
    assert url.hostname in services
    assert url.port in {port["port"] for port in services[url.hostname]["spec"]["ports"]}


def test_the_external_redis_overlay_is_the_base_without_valkey(base: list[dict]) -> None:
    overlay = render(DEPLOY / "overlays" / "external-redis")
    valkey = [obj for obj in base if obj["metadata"]["name"] == "kvcache-valkey"]
    assert {obj["kind"] for obj in valkey} == {"StatefulSet", "Service", "NetworkPolicy"}
    assert overlay == [obj for obj in base if obj not in valkey]


def test_the_engine_example_publishes_to_ingest_as_the_service_hashes(base: list[dict]) -> None:
    engine = _one_document(ENGINE_EXAMPLE)
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    argv = container["command"] + container["args"]
    given = options(argv)
    events = json.loads(given["kv-events-config"])
    env = {var["name"]: var for var in container["env"]}
    (config_map,) = [obj for obj in base if obj["kind"] == "ConfigMap"]
    ingest_service = _find(base, "Service", "kvcache-ingest")
    ingest = next(w for w in workloads(base) if pod_labels(w)["app.kubernetes.io/component"] == "ingest")
    ingest_options = options(manage_py_command(ingest["spec"]["template"]["spec"]["containers"][0]))
    http_port = container_port(container, "http")

    assert given["prefix-caching-hash-algo"] == "sha256_cbor"
    assert env["PYTHONHASHSEED"]["value"] == config_map["data"]["KVCACHE_HASH_SEED"]
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    endpoint = urlsplit(events["endpoint"])
    assert (endpoint.scheme, endpoint.hostname) == ("tcp", ingest_service["metadata"]["name"])
    zmq_port = next(p["port"] for p in ingest_service["spec"]["ports"] if p["name"] == "zmq")
    assert endpoint.port == zmq_port
    # The topic names the pod by its address, so ingest registers it for the gateway and prober.
    prefix, pod, model = events["topic"].split("@", 2)
    assert f"{prefix}@" == ingest_options.get("topic", "kv@")
    assert pod == f"$(POD_IP):{http_port}"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert model == argv[2] == given.get("served-model-name", model)
    assert given["port"] == str(http_port)
    # Ingest finds the replay endpoint at the address's port + KVCACHE_REPLAY_PORT_OFFSET.
    replay_port = urlsplit(events["replay_endpoint"].replace("*", "0.0.0.0")).port
    assert replay_port == http_port + int(config_map["data"]["KVCACHE_REPLAY_PORT_OFFSET"])
    assert replay_port == container_port(container, "kv-replay")


@pytest.fixture(scope="module")
def pooled() -> list[dict]:
    return render(INFERENCE_POOL_OVERLAY)


def test_the_inference_pool_overlay_is_the_base_with_a_pool_and_its_epp(
    base: list[dict], pooled: list[dict]
) -> None:
    assert [obj for obj in pooled if obj in base] == base
    added = {(obj["kind"], obj["metadata"]["name"]) for obj in pooled if obj not in base}
    assert added == {
        ("InferencePool", "vllm-qwen3"),
        *((kind, "kvcache-epp") for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment")),
        ("Service", "kvcache-epp"),
        ("PodDisruptionBudget", "kvcache-epp"),
    }


def test_the_inference_pool_and_its_epp_agree(pooled: list[dict]) -> None:
    (pool,) = inference_pools(pooled)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert inference_pool_problems(pooled) == []


def test_the_vendored_crd_is_the_inference_pool_v1() -> None:
    path = CRDS[("inference.networking.k8s.io/v1", "InferencePool")]
    crd = _one_document(path)
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    assert crd["spec"]["names"]["plural"] == "inferencepools"
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    assert "Apache License 2.0" in path.read_text().partition("apiVersion:")[0]
    schema = crd_schema(path, "v1")
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False
    assert set(spec["required"]) == {"selector", "targetPorts"}
    assert "x-kubernetes-validations" not in spec["properties"]["endpointPickerRef"]


# --- the checks themselves fail on broken manifests ---------------------------------------------


def _find(objects: list[dict], kind: str, name: str) -> dict:
    return next(obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name)


def _container(objects: list[dict], workload: str) -> dict:
    return _find(objects, "Deployment", workload)["spec"]["template"]["spec"]["containers"][0]


def _typo_in_service_selector(objects: list[dict]) -> None:
    _find(objects, "Service", "kvcache-web")["spec"]["selector"]["app.kubernetes.io/component"] = "wbe"


def _service_port_nobody_declares(objects: list[dict]) -> None:
    _find(objects, "Service", "kvcache-ingest")["spec"]["ports"][1]["targetPort"] = "metric"


def _deployment_selector_misses_its_pods(objects: list[dict]) -> None:
    _find(objects, "Deployment", "kvcache-gateway")["spec"]["selector"]["matchLabels"]["extra"] = "x"


def _probe_on_undeclared_port(objects: list[dict]) -> None:
    _container(objects, "kvcache-web")["readinessProbe"]["httpGet"]["port"] = "htp"


def _missing_secret_key(objects: list[dict]) -> None:
    _container(objects, "kvcache-ingest")["env"][0]["valueFrom"]["secretKeyRef"]["key"] = "SECRET_KYE"


def _config_map_by_its_unhashed_name(objects: list[dict]) -> None:
    _container(objects, "kvcache-web")["envFrom"][0]["configMapRef"]["name"] = "kvcache-config"


def _variable_that_is_no_setting(objects: list[dict]) -> None:
    _container(objects, "kvcache-gateway")["env"].append({"name": "KVCACHE_INDEX_TIMEOUTS", "value": "2"})


def _config_key_that_is_no_setting(objects: list[dict]) -> None:
    next(obj for obj in objects if obj["kind"] == "ConfigMap")["data"]["LOGLEVEL"] = "DEBUG"


def _expansion_before_its_variable(objects: list[dict]) -> None:
    env = _container(objects, "kvcache-web")["env"]
    env.append(env.pop(next(i for i, var in enumerate(env) if var["name"] == "POD_IP")))


def _other_image_tag(objects: list[dict]) -> None:
    _container(objects, "kvcache-gateway")["image"] = "kvcache-router:0.0.9"


def _replace_argument(container: dict, prefix: str, new: str) -> None:
    (i,) = [i for i, arg in enumerate(container["command"]) if arg.startswith(prefix)]
    container["command"][i] = new


def _port_argument_differs_from_the_container_port(objects: list[dict]) -> None:
    _replace_argument(_container(objects, "kvcache-web"), "--port=", "--port=8001")


def _unknown_command_option(objects: list[dict]) -> None:
    _replace_argument(_container(objects, "kvcache-ingest"), "--metrics-port=", "--metric-port=9101")


def _option_the_init_script_command_lacks(objects: list[dict]) -> None:
    (init,) = _find(objects, "Deployment", "kvcache-gateway")["spec"]["template"]["spec"]["initContainers"]
    init["command"][2] = init["command"][2].replace("--check", "--chek")


def _field_kubernetes_does_not_have(objects: list[dict]) -> None:
    container = _container(objects, "kvcache-web")
    container["readinesProbe"] = container.pop("readinessProbe")


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], Callable[[list[dict]], list[str]]]] = {
    "typo in a Service selector": (_typo_in_service_selector, selector_problems),
    "Service port no container declares": (_service_port_nobody_declares, selector_problems),
    "Deployment selector missing its pods": (_deployment_selector_misses_its_pods, workload_problems),
    "probe on an undeclared port": (_probe_on_undeclared_port, probe_problems),
    "Secret key that does not exist": (
        _missing_secret_key,
        lambda objects: reference_problems(objects, [operator_secret()]),
    ),
    "ConfigMap by its unhashed name": (
        _config_map_by_its_unhashed_name,
        lambda objects: reference_problems(objects, [operator_secret()]),
    ),
    "variable that is no setting": (
        _variable_that_is_no_setting,
        lambda objects: env_name_problems(objects, [operator_secret()], settings_names()),
    ),
    "ConfigMap key that is no setting": (
        _config_key_that_is_no_setting,
        lambda objects: env_name_problems(objects, [operator_secret()], settings_names()),
    ),
    "$(POD_IP) before POD_IP": (_expansion_before_its_variable, expansion_problems),
    "another image tag": (_other_image_tag, image_problems),
    "--port unlike the container port": (_port_argument_differs_from_the_container_port, command_problems),
    "option the command does not have": (_unknown_command_option, command_problems),
    "option in an init script": (_option_the_init_script_command_lacks, command_problems),
    "field Kubernetes does not have": (_field_kubernetes_does_not_have, schema_problems),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_check_fails_on_a_broken_manifest(base: list[dict], breakage: str) -> None:
    breaking, check = BREAKAGES[breakage]
    assert check(base) == []
    broken = copy.deepcopy(base)
    breaking(broken)
    assert check(broken) != []
    assert all_problems(broken) != []


def _epp(objects: list[dict]) -> dict:
    return _container(objects, "kvcache-epp")


def _pool(objects: list[dict]) -> dict:
    (pool,) = inference_pools(objects)
    return pool


def _field_the_inference_pool_crd_does_not_have(objects: list[dict]) -> None:
    _pool(objects)["spec"]["targetPort"] = 8000


def _inference_pool_port_out_of_range(objects: list[dict]) -> None:
    _pool(objects)["spec"]["targetPorts"][0]["number"] = 80000


def _endpoint_picker_on_another_port(objects: list[dict]) -> None:
    _pool(objects)["spec"]["endpointPickerRef"]["port"]["number"] = 9003


def _inference_pool_selector_missing_the_engines(objects: list[dict]) -> None:
    _pool(objects)["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "vllm-qwen"


def _epp_reads_another_pool(objects: list[dict]) -> None:
    _replace_argument(_epp(objects), "--pool-name=", "--pool-name=qwen3")


def _epp_grpc_port_unlike_its_container_port(objects: list[dict]) -> None:
    _replace_argument(_epp(objects), "--grpc-port=", "--grpc-port=9003")


def _epp_option_the_command_does_not_have(objects: list[dict]) -> None:
    _replace_argument(_epp(objects), "--pool-model=", "--model=Qwen/Qwen3-0.6B")


def _role_without_watch(objects: list[dict]) -> None:
    _find(objects, "Role", "kvcache-epp")["rules"][1]["verbs"] = ["list"]


def _epp_service_selecting_no_epp(objects: list[dict]) -> None:
    _find(objects, "Service", "kvcache-epp")["spec"]["selector"]["app.kubernetes.io/component"] = "ep"


INFERENCE_POOL_BREAKAGES: dict[
    str, tuple[Callable[[list[dict]], None], Callable[[list[dict]], list[str]]]
] = {
    "field the InferencePool CRD does not have": (
        _field_the_inference_pool_crd_does_not_have,
        schema_problems,
    ),
    "InferencePool port out of range": (_inference_pool_port_out_of_range, schema_problems),
    "endpoint picker on another port": (_endpoint_picker_on_another_port, inference_pool_problems),
    "InferencePool missing the engines": (
        _inference_pool_selector_missing_the_engines,
        inference_pool_problems,
    ),
    "EPP reading another pool": (_epp_reads_another_pool, inference_pool_problems),
    "EPP --grpc-port unlike its port": (_epp_grpc_port_unlike_its_container_port, command_problems),
    "EPP option it does not have": (_epp_option_the_command_does_not_have, command_problems),
    "Role without watch": (_role_without_watch, inference_pool_problems),
    "EPP Service selecting no EPP": (_epp_service_selecting_no_epp, inference_pool_problems),
}


@pytest.mark.parametrize("breakage", list(INFERENCE_POOL_BREAKAGES))
def test_each_inference_pool_check_fails_on_a_broken_manifest(pooled: list[dict], breakage: str) -> None:
    breaking, check = INFERENCE_POOL_BREAKAGES[breakage]
    assert check(pooled) == []
    broken = copy.deepcopy(pooled)
    breaking(broken)
    assert check(broken) != []
    assert all_problems(broken) != []


# --- the renderer itself ---------------------------------------------------------------------------


def _write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  selector: {matchLabels: {app: a}}
  template:
    metadata: {labels: {app: a}}
    spec:
      containers:
        - name: app
          image: app
          envFrom: [{configMapRef: {name: settings}}]
"""


def test_render_hashes_generated_config_maps_and_follows_their_references(tmp_path: Path) -> None:
    kustomization = "resources: [app.yaml]\nconfigMapGenerator: [{name: settings, envs: [s.env]}]\n"
    kustomization += "images: [{name: app, newName: registry.example/app, newTag: '1.2'}]\n"
    _write(tmp_path, {"kustomization.yaml": kustomization, "app.yaml": DEPLOYMENT, "s.env": "# c\nA=1\n"})
    first = render(tmp_path)
    (tmp_path / "s.env").write_text("A=2\n")
    second = render(tmp_path)

    names = []
    for objects, value in ((first, "1"), (second, "2")):
        config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap")
        assert config_map["data"] == {"A": value}
        deployment = next(obj for obj in objects if obj["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["envFrom"][0]["configMapRef"]["name"] == config_map["metadata"]["name"]
        assert container["image"] == "registry.example/app:1.2"
        names.append(config_map["metadata"]["name"])
    assert names[0].startswith("settings-") and names[0] != names[1]


def test_render_deletes_an_object_of_the_base(tmp_path: Path) -> None:
    base, overlay = tmp_path / "base", tmp_path / "overlay"
    base.mkdir()
    overlay.mkdir()
    _write(base, {"kustomization.yaml": "resources: [app.yaml]\n", "app.yaml": DEPLOYMENT})
    delete = "$patch: delete\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
    _write(
        overlay, {"kustomization.yaml": "resources: [../base]\npatches: [{path: d.yaml}]\n", "d.yaml": delete}
    )
    assert len(render(base)) == 1
    assert render(overlay) == []


def test_render_renames_a_base_config_map_in_an_overlay_resource(tmp_path: Path) -> None:
    base, overlay = tmp_path / "base", tmp_path / "overlay"
    base.mkdir()
    overlay.mkdir()
    generator = "configMapGenerator: [{name: settings, envs: [s.env]}]\n"
    _write(base, {"kustomization.yaml": generator, "s.env": "A=1\n"})
    other = DEPLOYMENT.replace("name: app}", "name: other}")
    _write(overlay, {"kustomization.yaml": "resources: [../base, other.yaml]\n", "other.yaml": other})
    objects = render(overlay)
    config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap")
    (container,) = next(obj for obj in objects if obj["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    assert config_map["metadata"]["name"].startswith("settings-")
    assert container["envFrom"][0]["configMapRef"]["name"] == config_map["metadata"]["name"]


PATCH = "resources: [app.yaml]\npatches: [{path: p.yaml}]\n"
GENERATOR = "resources: [app.yaml]\nconfigMapGenerator: [{name: s, envs: [s.env]}]\n"
REFUSED = {
    "namePrefix": ({"kustomization.yaml": "namePrefix: x-\nresources: [app.yaml]\n"}, "namePrefix"),
    "commonLabels": ({"kustomization.yaml": "resources: [app.yaml]\ncommonLabels: {a: b}\n"}, "commonLabels"),
    "merge patch": (
        {
            "kustomization.yaml": PATCH,
            "p.yaml": "kind: Deployment\nmetadata: {name: app}\nspec: {replicas: 3}\n",
        },
        "whole-object deletions",
    ),
    "two patches in one file": (
        {"kustomization.yaml": PATCH, "p.yaml": "$patch: delete\nkind: A\n---\n$patch: delete\nkind: B\n"},
        "2 documents",
    ),
    "patch without a target": (
        {
            "kustomization.yaml": PATCH,
            "p.yaml": "$patch: delete\napiVersion: v1\nkind: Service\nmetadata: {name: app}\n",
        },
        "matches no object",
    ),
    "bare key in an env file": ({"kustomization.yaml": GENERATOR, "s.env": "A\n"}, "KEY=VALUE"),
    "quoted value in an env file": ({"kustomization.yaml": GENERATOR, "s.env": 'A="1"\n'}, "unquoted"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_render_refuses_what_it_does_not_implement(tmp_path: Path, case: str) -> None:
    files, complaint = REFUSED[case]
    _write(tmp_path, {"app.yaml": DEPLOYMENT, **files})
    with pytest.raises(Unsupported, match=complaint):
        render(tmp_path)
