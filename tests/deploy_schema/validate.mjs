// Validates every object of every overlay in deploy/kubernetes/overlays, as `kubectl kustomize`
// renders it, against the Kubernetes API's OpenAPI schemas (kubernetes-models; the PodMonitor
// and PrometheusRule against the Prometheus Operator's CRD schemas): types, enums, formats and
// required fields. Unknown fields are not caught (the schemas allow them); tests/deploy_test.py
// checks the names that matter, and KEDA's ScaledObject, for which no schema is pinned.
// Then it breaks one field on purpose and checks that the
// validator notices.
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
      new Model(obj).validate();
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
// The validator must reject a broken object, or the checks above prove nothing.
const broken = structuredClone(deployment.obj);
broken.spec.template.spec.containers[0].ports[0].containerPort = 'grpc';
let caught = false;
try {
  new deployment.Model(broken).validate();
} catch (e) {
  caught = true;
}
if (!caught) {
  console.log('the validator accepted a string containerPort');
  ++failures;
}
console.log(`${checked} objects valid, ${failures} failures`);
process.exit(failures === 0 && checked > 0 ? 0 : 1);
