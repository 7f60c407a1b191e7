// Contract test: a Node.js client (@grpc/grpc-js + @grpc/proto-loader) against a real specdec selector.
//
//   node selector_contract.mjs HOST:PORT
//
// Prints one line per check ("ok - ..." or "not ok - ...") and exits non-zero when any check fails.
import assert from 'node:assert/strict';

import { connect, invalidArgument, runChecks, unary, unaryError } from './grpc_helpers.mjs';

const { client: selector, health } = connect('specdec/v1/selector.proto', 'specdec.v1.BackendSelector');

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
      const violations = invalidArgument(err, ['attention.backend']);
      assert.ok(err.details.startsWith(INVALID_BACKEND_MESSAGE), `message: ${err.details}`);
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
      invalidArgument(await unaryError(selector, 'SelectBackends', request), ['hardware']);
    },
  ],
];

const failures = await runChecks(checks);
selector.close();
health.close();
process.exitCode = failures ? 1 : 0;
