// Contract test: a Node.js client (@grpc/grpc-js + @grpc/proto-loader) against a real specdec selector.
//
//   node selector_contract.mjs HOST:PORT
//
// Prints one line per check ("ok - ..." or "not ok - ...") and exits non-zero when any check fails.
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PROTOS_ROOT = path.resolve(HERE, '..', '..', '..', 'protos');
const DEADLINE_MS = 10_000;

const address = process.argv[2];
if (!address) {
  console.error('usage: node selector_contract.mjs HOST:PORT');
  process.exit(2);
}

const packageDefinition = protoLoader.loadSync(['specdec/v1/selector.proto', path.join(HERE, 'health.proto')], {
  keepCase: true,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTOS_ROOT],
});
const loaded = grpc.loadPackageDefinition(packageDefinition);
const credentials = grpc.credentials.createInsecure();
const selector = new loaded.specdec.v1.BackendSelector(address, credentials);
const health = new loaded.grpc.health.v1.Health(address, credentials);

// google.rpc.Status and its details, to decode the grpc-status-details-bin trailer (field names as in the .proto).
const statusRoot = new protobuf.Root().loadSync(path.join(HERE, 'status.proto'), { keepCase: true });
const RpcStatus = statusRoot.lookupType('google.rpc.Status');
const detailTypes = new Map(
  ['google.rpc.BadRequest', 'google.rpc.PreconditionFailure'].map((name) => [
    `type.googleapis.com/${name}`,
    statusRoot.lookupType(name),
  ]),
);

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + DEADLINE_MS }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

// Call a unary method that must fail; returns the grpc-js ServiceError.
async function unaryError(client, method, request) {
  let response;
  try {
    response = await unary(client, method, request);
  } catch (err) {
    return err;
  }
  assert.fail(`${method} succeeded but was expected to fail: ${JSON.stringify(response)}`);
}

// The google.rpc.Status of a failed call, its details unpacked: [{typeUrl, message}].
function richStatus(err) {
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

function badRequestViolations(status) {
  const badRequests = status.details.filter((d) => d.typeUrl === 'type.googleapis.com/google.rpc.BadRequest');
  assert.equal(badRequests.length, 1, 'exactly one google.rpc.BadRequest detail');
  return badRequests[0].message.field_violations;
}

const DFLASH_REQUEST = Object.freeze({
  hardware: {
    platform: 'PLATFORM_CUDA',
    compute_capability_major: 9,
    libraries: [
      { name: 'torch', version: '2.11' },
      { name: 'triton', version: '3.6' },
      { name: 'flash_attn', version: '4.0.0b36' },
    ],
  },
  target_layers: { head_size: 128, num_heads: 32, num_kv_heads: 8, dtype: 'DTYPE_BFLOAT16' },
  speculative: {
    method: 'SPEC_METHOD_DFLASH',
    num_speculative_tokens: 15,
    dflash_config: { mask_token_id: 5, block_size: 16 },
  },
});

const EXPECTED_CANDIDATES = [
  { backend: 'FLASH_ATTN', reasons: [] },
  { backend: 'FLASHINFER', reasons: ['flashinfer not installed'] },
  { backend: 'TRITON_ATTN', reasons: [] },
  { backend: 'FLEX_ATTENTION', reasons: [] },
];

const INVALID_BACKEND_MESSAGE =
  "Selected backend FLASHINFER is not valid for this configuration. Reason: ['flashinfer not installed']";

const checks = [
  [
    'health: "" and "specdec.v1.BackendSelector" are SERVING',
    async () => {
      for (const service of ['', 'specdec.v1.BackendSelector']) {
        const response = await unary(health, 'Check', { service });
        assert.equal(response.status, 'SERVING', `health of "${service}"`);
      }
    },
  ],
  [
    'SelectBackends: DFlash on SM 9.0 picks FLASH_ATTN for both, non-causal drafter',
    async () => {
      const response = await unary(selector, 'SelectBackends', DFLASH_REQUEST);
      for (const [role, nonCausal] of [
        ['target', false],
        ['drafter', true],
      ]) {
        const decision = response[role];
        assert.ok(decision, `${role} decision present`);
        assert.equal(decision.backend, 'FLASH_ATTN', `${role}.backend`);
        assert.equal(decision.explicit, false, `${role}.explicit`);
        assert.equal(decision.use_non_causal, nonCausal, `${role}.use_non_causal`);
        assert.deepEqual(
          decision.candidates.map(({ backend, reasons }) => ({ backend, reasons })),
          EXPECTED_CANDIDATES,
          `${role}.candidates`,
        );
      }
    },
  ],
  [
    'SelectBackends: explicit flashinfer is INVALID_ARGUMENT with BadRequest on attention.backend',
    async () => {
      const request = { ...DFLASH_REQUEST, attention: { backend: 'flashinfer' } };
      const err = await unaryError(selector, 'SelectBackends', request);
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT, `code (${err.details})`);
      assert.ok(err.details.startsWith(INVALID_BACKEND_MESSAGE), `message: ${err.details}`);
      const status = richStatus(err);
      assert.equal(status.code, grpc.status.INVALID_ARGUMENT, 'google.rpc.Status.code');
      assert.equal(status.message, err.details, 'google.rpc.Status.message matches grpc-message');
      const violations = badRequestViolations(status);
      assert.deepEqual(
        violations.map((v) => v.field),
        ['attention.backend'],
        'field violations',
      );
      assert.ok(violations[0].description.includes('flashinfer not installed'), violations[0].description);
    },
  ],
  [
    'ListBackends: 8 backends including CPU_ATTN, non-empty reason vocabulary',
    async () => {
      const response = await unary(selector, 'ListBackends', {});
      const names = response.backends.map((b) => b.name);
      assert.equal(names.length, 8, `backends: ${names.join(', ')}`);
      assert.equal(new Set(names).size, 8, 'backend names are unique');
      assert.ok(names.includes('CPU_ATTN'), `CPU_ATTN in ${names.join(', ')}`);
      assert.ok(response.reason_vocabulary.length > 0, 'reason_vocabulary is non-empty');
      // Every reason SelectBackends gave above is one of the vocabulary's.
      for (const { reasons } of EXPECTED_CANDIDATES) {
        for (const reason of reasons) {
          assert.ok(response.reason_vocabulary.includes(reason), `"${reason}" in reason_vocabulary`);
        }
      }
    },
  ],
  [
    'SelectBackends: no hardware is INVALID_ARGUMENT with BadRequest on hardware',
    async () => {
      const { hardware: _omitted, ...request } = DFLASH_REQUEST;
      const err = await unaryError(selector, 'SelectBackends', request);
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT, `code (${err.details})`);
      const violations = badRequestViolations(richStatus(err));
      assert.deepEqual(
        violations.map((v) => v.field),
        ['hardware'],
        'field violations',
      );
    },
  ],
];

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
selector.close();
health.close();
console.log(failures ? `${failures} of ${checks.length} checks failed` : `all ${checks.length} checks passed`);
process.exitCode = failures ? 1 : 0;
