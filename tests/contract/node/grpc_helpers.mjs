// What the Node.js contract tests share: loading the protos, calling (unary and server streaming), decoding the
// google.rpc.Status of a failed call from its `grpc-status-details-bin` trailer, and running named checks.
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PROTOS_ROOT = path.resolve(HERE, '..', '..', '..', 'protos');
const DEADLINE_MS = 10_000;

// Clients of `service` (e.g. 'specdec.v1.Executor', defined in `protoFile` under protos/) and of grpc.health.v1.Health
// at the HOST:PORT given on the command line. Field names as in the .proto files, enums as their names,
// 64-bit integers as decimal strings (as in protobuf's JSON mapping).
export function connect(protoFile, service) {
  const address = process.argv[2];
  if (!address) {
    console.error(`usage: node ${path.basename(process.argv[1])} HOST:PORT`);
    process.exit(2);
  }
  const packageDefinition = protoLoader.loadSync([protoFile, path.join(HERE, 'health.proto')], {
    keepCase: true,
    enums: String,
    longs: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTOS_ROOT],
  });
  const loaded = grpc.loadPackageDefinition(packageDefinition);
  const Service = service.split('.').reduce((scope, name) => scope[name], loaded);
  const credentials = grpc.credentials.createInsecure();
  const health = new loaded.grpc.health.v1.Health(address, credentials);
  return { client: new Service(address, credentials), health };
}

// google.rpc.Status and its details, to decode the grpc-status-details-bin trailer (field names as in the .proto).
const statusRoot = new protobuf.Root().loadSync(path.join(HERE, 'status.proto'), { keepCase: true });
const RpcStatus = statusRoot.lookupType('google.rpc.Status');
const detailTypes = new Map(
  ['google.rpc.BadRequest', 'google.rpc.PreconditionFailure'].map((name) => [
    `type.googleapis.com/${name}`,
    statusRoot.lookupType(name),
  ]),
);

export function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + DEADLINE_MS }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

// Every message of a server-streaming call, in order; rejects with the grpc-js ServiceError if it fails.
export function serverStream(client, method, request) {
  return new Promise((resolve, reject) => {
    const messages = [];
    const call = client[method](request, { deadline: Date.now() + DEADLINE_MS });
    call.on('data', (message) => messages.push(message));
    call.on('error', reject); // emitted before 'end' when the status is not OK
    call.on('end', () => resolve(messages));
  });
}

// Await a call that must fail; returns the grpc-js ServiceError.
export async function rejection(call, what) {
  let response;
  try {
    response = await call;
  } catch (err) {
    return err;
  }
  assert.fail(`${what} succeeded but was expected to fail: ${JSON.stringify(response)}`);
}

export function unaryError(client, method, request) {
  return rejection(unary(client, method, request), method);
}

// The google.rpc.Status of a failed call, its details unpacked: [{typeUrl, message}].
export function richStatus(err) {
  const raw = err.metadata?.get('grpc-status-details-bin') ?? [];
  assert.equal(raw.length, 1, 'exactly one grpc-status-details-bin trailer');
  const status = RpcStatus.toObject(RpcStatus.decode(raw[0]), { defaults: true });
  status.details = status.details.map((any) => {
    const type = detailTypes.get(any.type_url);
    assert.ok(type, `unexpected detail type ${any.type_url}`);
    return { typeUrl: any.type_url, message: type.toObject(type.decode(any.value), { defaults: true }) };
  });
  return status;
}

export function badRequestViolations(status) {
  const badRequests = status.details.filter((d) => d.typeUrl === 'type.googleapis.com/google.rpc.BadRequest');
  assert.equal(badRequests.length, 1, 'exactly one google.rpc.BadRequest detail');
  return badRequests[0].message.field_violations;
}

// Check that a failed call is INVALID_ARGUMENT with a google.rpc.Status to match, whose BadRequest names exactly
// `fields`; returns its field violations.
export function invalidArgument(err, fields) {
  assert.equal(err.code, grpc.status.INVALID_ARGUMENT, `code (${err.details})`);
  const status = richStatus(err);
  assert.equal(status.code, grpc.status.INVALID_ARGUMENT, 'google.rpc.Status.code');
  assert.equal(status.message, err.details, 'google.rpc.Status.message matches grpc-message');
  const violations = badRequestViolations(status);
  assert.deepEqual(
    violations.map((v) => v.field),
    fields,
    'field violations',
  );
  return violations;
}

// Run [name, async check] pairs in order, printing "ok - name" or "not ok - name" and why; returns the failures.
export async function runChecks(checks) {
  let failures = 0;
  for (const [name, check] of checks) {
    try {
      await check();
      console.log(`ok - ${name}`);
    } catch (err) {
      failures += 1;
      console.log(`not ok - ${name}`);
      const detail = err instanceof assert.AssertionError || err?.code !== undefined ? err.message : err?.stack;
      console.log(`  ${String(detail ?? err).replaceAll('\n', '\n  ')}`);
    }
  }
  console.log(failures ? `${failures} of ${checks.length} checks failed` : `all ${checks.length} checks passed`);
  return failures;
}
