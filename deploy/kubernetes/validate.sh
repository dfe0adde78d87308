#!/usr/bin/env bash
# Validates every manifest of deploy/kubernetes: the built-in kinds with PyPI's
# kubernetes-validate (--strict: unknown fields fail) against Kubernetes 1.31's schemas; the
# ServiceMonitor (a CRD kubernetes-validate has no schema for) with jsonschema against
# schemas/servicemonitor-v1.subset.json and, when SERVICEMONITOR_CRD names the Prometheus
# Operator's CRD YAML, against that CRD's full openAPIV3Schema; kustomization.yaml lists only
# files that exist, and every manifest is listed (or named as optional).
#   deploy/kubernetes/validate.sh        # quick (a few seconds after the pip install); run by .ci/run
set -euo pipefail
cd "$(dirname "$0")"
python3 -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null \
    || pip install -q --disable-pip-version-check kubernetes-validate jsonschema pyyaml
k8s_version=${K8S_VERSION:-1.31.0}
manifests=$(ls *.yaml | grep -v '^kustomization.yaml$')
echo "== kubernetes-validate --strict -k $k8s_version"
out=$(kubernetes-validate --strict -k "$k8s_version" $manifests 2>&1) || { echo "$out"; echo "FAIL: kubernetes-validate"; exit 1; }
echo "$out"
# A warning about a missing schema is a failure for every kind but the ServiceMonitor.
if echo "$out" | grep "Couldn't find schema" | grep -v "kind ServiceMonitor " | grep -q .; then
    echo "FAIL: a manifest kind without a schema"; exit 1
fi
python3 - <<'PY'
import glob, json, os, sys
import jsonschema, yaml

docs = {}
for path in sorted(glob.glob("*.yaml")):
    with open(path) as f:
        docs[path] = [d for d in yaml.safe_load_all(f) if d]

failed = False
monitors = [(p, d) for p, ds in docs.items() for d in ds if d.get("kind") == "ServiceMonitor"]
assert monitors, "no ServiceMonitor found"
with open("schemas/servicemonitor-v1.subset.json") as f:
    subset = json.load(f)
schemas = [("subset schema", subset)]
crd_path = os.environ.get("SERVICEMONITOR_CRD")
if crd_path:
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    label = crd["metadata"].get("annotations", {}).get("operator.prometheus.io/version", "?")
    schemas.append((f"CRD {crd['metadata']['name']} (operator {label})", version["schema"]["openAPIV3Schema"]))
for path, doc in monitors:
    for name, schema in schemas:
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
        if errors:
            failed = True
            for e in errors:
                print(f"FAIL {path}: ServiceMonitor/{doc['metadata']['name']} against the {name}: {e.message} at {list(e.path)}")
        else:
            print(f"INFO {path} passed for resource servicemonitor/{doc['metadata']['name']} against the {name}")

with open("kustomization.yaml") as f:
    kust = yaml.safe_load(f)
listed = set(kust["resources"])
optional = {"rbac-inferencepool.yaml"}
for r in sorted(listed):
    if not os.path.exists(r):
        failed = True
        print(f"FAIL kustomization.yaml lists {r}, which does not exist")
for p in sorted(set(docs) - {"kustomization.yaml"} - listed - optional):
    failed = True
    print(f"FAIL {p} is not in kustomization.yaml's resources")

# The ConfigMap's config.toml must use Kubernetes discovery in the namespace the Role covers.
import tomllib
cm = next(d for d in docs["configmap.yaml"] if d["kind"] == "ConfigMap")
cfg = tomllib.loads(cm["data"]["config.toml"])
role_ns = {d["metadata"]["namespace"] for d in docs["rbac.yaml"] if d["kind"] == "Role"}
if cfg["discovery"]["source"] != "kubernetes" or {cfg["discovery"]["kubernetes"]["namespace"]} != role_ns:
    failed = True
    print("FAIL configmap.yaml: discovery is not Kubernetes in the Role's namespace")
sel = dict(kv.split("=") for kv in cfg["discovery"]["kubernetes"]["label_selector"].split(","))
vllm = next(d for d in docs["vllm-example.yaml"] if d["kind"] == "Deployment")
labels = vllm["spec"]["template"]["metadata"]["labels"]
ports = {p["name"] for c in vllm["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
if any(labels.get(k) != v for k, v in sel.items()) or cfg["discovery"]["kubernetes"]["port"] not in ports:
    failed = True
    print("FAIL vllm-example.yaml: its Pods are not what configmap.yaml's discovery selects")
else:
    print(f"INFO vllm-example.yaml Pods match the discovery selector {sel} and port {cfg['discovery']['kubernetes']['port']!r}")
print("FAIL" if failed else "PASS")
sys.exit(1 if failed else 0)
PY
