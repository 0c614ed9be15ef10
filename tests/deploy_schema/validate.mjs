// Validates every object of every overlay in deploy/kubernetes/overlays, as `kubectl kustomize`
// renders it, against the Kubernetes API's OpenAPI schemas (kubernetes-models; the PodMonitor
// and PrometheusRule against the Prometheus Operator's CRD schemas): types, enums, formats and
// required fields, and unknown fields (a misspelt `readOnlyRootFilesytem` is silently dropped by
// the API server, so it must fail here): the schemas allow extra fields, so the validator runs on
// proxies that record which fields it reads; the compiled validators read every field they know
// and enumerate only maps (labels, annotations, ConfigMap data), so a field never read in an
// object never enumerated is one the schema lacks. KEDA's ScaledObject, for which no schema is
// pinned, is checked by tests/deploy_test.py. Then it breaks fields on purpose and checks that
// the validator notices.
//   node tests/deploy_schema/validate.mjs deploy/kubernetes
import { execFileSync } from 'child_process';
import fs from 'fs';
import path from 'path';
import YAML from 'yaml';

async function modelFor(apiVersion, kind) {
  const mod = apiVersion.startsWith('monitoring.coreos.com/')
    ? await import(`@kubernetes-models/prometheus-operator/${apiVersion}`)
    : await import(`kubernetes-models/${apiVersion}`);
  if (!mod[kind]) throw new Error(`no schema for ${apiVersion} ${kind}`);
  return mod[kind];
}

// Wraps `value` so that validation records what it reads; `nodes` collects every object's record.
function tracked(value, path, nodes) {
  if (value === null || typeof value !== 'object') return value;
  const node = { path, value, read: new Set(), enumerated: Array.isArray(value) };
  nodes.push(node);
  const children = new Map();
  for (const [k, v] of Object.entries(value)) {
    children.set(k, tracked(v, Array.isArray(value) ? `${path}[${k}]` : `${path}.${k}`, nodes));
  }
  return new Proxy(value, {
    get(target, key, receiver) {
      if (typeof key === 'string') node.read.add(key);
      return children.has(key) ? children.get(key) : Reflect.get(target, key, receiver);
    },
    ownKeys(target) {
      node.enumerated = true;
      return Reflect.ownKeys(target);
    },
  });
}

// Validates `obj` with `Model`'s schema; throws on a schema error or an unknown field.
function validateStrict(Model, obj) {
  const nodes = [];
  Model.prototype.validate.call(tracked(obj, '', nodes));
  const unknown = [];
  for (const n of nodes) {
    if (n.enumerated) continue;
    for (const k of Object.keys(n.value)) if (!n.read.has(k)) unknown.push(`${n.path}.${k}`.slice(1));
  }
  if (unknown.length) throw new Error(`unknown field(s): ${unknown.join(', ')}`);
}

const dir = process.argv[2];
let failures = 0, checked = 0, deployment = null;
const overlays = fs.readdirSync(path.join(dir, 'overlays')).sort();
for (const overlay of overlays) {
  const rendered = execFileSync('kubectl', ['kustomize', path.join(dir, 'overlays', overlay)],
                                { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  for (const doc of YAML.parseAllDocuments(rendered)) {
    const obj = doc.toJSON();
    if (!obj) continue;
    const what = `${overlay}: ${obj.apiVersion} ${obj.kind} ${obj.metadata?.name ?? ''}`;
    if (obj.apiVersion.startsWith('keda.sh/')) {  // no KEDA schema among the pinned packages:
      console.log(`skipped ${what} (tests/deploy_test.py checks its fields)`);
      continue;
    }
    try {
      const Model = await modelFor(obj.apiVersion, obj.kind);
      validateStrict(Model, obj);
      ++checked;
      console.log(`valid   ${what}`);
      if (obj.kind === 'Deployment') deployment = { Model, obj };
    } catch (e) {
      ++failures;
      console.log(`INVALID ${what}: ${e.message}`);
    }
  }
}
if (!deployment) {
  console.log('no Deployment found');
  process.exit(1);
}
// The validator must reject broken objects, or the checks above prove nothing.
const breakages = {
  'a string containerPort': (d) => { d.spec.template.spec.containers[0].ports[0].containerPort = 'grpc'; },
  'a misspelt readOnlyRootFilesytem': (d) => {
    d.spec.template.spec.containers[0].securityContext.readOnlyRootFilesytem = true;
  },
  'an unknown field at the top of the pod spec': (d) => { d.spec.template.spec.tolerance = []; },
};
for (const [what, breakIt] of Object.entries(breakages)) {
  const broken = structuredClone(deployment.obj);
  breakIt(broken);
  let caught = false;
  try {
    validateStrict(deployment.Model, broken);
  } catch (e) {
    caught = true;
  }
  if (!caught) {
    console.log(`the validator accepted ${what}`);
    ++failures;
  }
}
console.log(`${checked} objects valid, ${failures} failures`);
process.exit(failures === 0 && checked > 0 ? 0 : 1);
