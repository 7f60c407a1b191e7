// Contract test: a Node.js client (@grpc/grpc-js + @grpc/proto-loader) against a real specdec executor that has
// no model loaded yet (it loads a synthetic tiny llama itself).
//
//   node executor_contract.mjs HOST:PORT
//
// Prints one line per check ("ok - ..." or "not ok - ..."), then, on the last line, a JSON summary of what it
// received (for the Python side to compare with what its own client gets), and exits non-zero when any check
// fails.
import assert from 'node:assert/strict';

import {
  badRequestViolations,
  connect,
  invalidArgument,
  rejection,
  richStatus,
  runChecks,
  serverStream,
  unary,
} from './grpc_helpers.mjs';

const { client: executor, health } = connect('specdec/v1/executor.proto', 'specdec.v1.Executor');

const TINY_LLAMA = Object.freeze({
  target: {
    synthetic: {
      architecture: 'llama',
      vocab_size: 512,
      hidden_size: 64,
      intermediate_size: 128,
      num_layers: 2,
      num_heads: 4,
      num_kv_heads: 2,
      head_size: 32,
      seed: 0,
    },
  },
  dtype: 'DTYPE_FLOAT32',
  num_kv_blocks: 64,
});
const PROMPT = [1, 2, 3, 4, 5];
const MAX_TOKENS = 6;

const summary = {};

async function expectHealth(expected) {
  for (const service of ['', 'specdec.v1.Executor']) {
    const response = await unary(health, 'Check', { service });
    assert.equal(response.status, expected, `health of "${service}"`);
  }
}

const checks = [
  ['health: "" and "specdec.v1.Executor" are NOT_SERVING before LoadModel', () => expectHealth('NOT_SERVING')],
  [
    'GetCapabilities: the CPU, torch importable',
    async () => {
      const capabilities = await unary(executor, 'GetCapabilities', {});
      summary.capabilities = capabilities;
      assert.equal(capabilities.platform, 'PLATFORM_CPU', 'platform');
      assert.ok(
        capabilities.libraries.some((library) => library.name === 'torch'),
        `torch in ${JSON.stringify(capabilities.libraries)}`,
      );
    },
  ],
  [
    'LoadModel: a synthetic tiny llama, float32, 64 KV blocks, on CPU_ATTN',
    async () => {
      const response = await unary(executor, 'LoadModel', TINY_LLAMA);
      summary.load = { target_backend: response.target_backend, info: response.info };
      assert.equal(response.target_backend.backend, 'CPU_ATTN', 'target_backend.backend');
      const { architecture, vocab_size, num_layers, dtype, num_kv_blocks } = response.info;
      assert.deepEqual(
        { architecture, vocab_size, num_layers, dtype, num_kv_blocks },
        { architecture: 'llama', vocab_size: 512, num_layers: 2, dtype: 'DTYPE_FLOAT32', num_kv_blocks: 64 },
        'info',
      );
    },
  ],
  ['health: SERVING after LoadModel', () => expectHealth('SERVING')],
  [
    `Generate: ${MAX_TOKENS} greedy tokens streamed, the last message finished with "length"`,
    async () => {
      const request = { request_id: 'node', token_ids: { ids: PROMPT }, sampling: { max_tokens: MAX_TOKENS } };
      const messages = await serverStream(executor, 'Generate', request);
      const tokenIds = messages.flatMap((message) => message.token_ids);
      const last = messages.at(-1);
      summary.generate = { token_ids: tokenIds, messages: messages.length, finished: last?.finished ?? null };
      assert.ok(messages.length >= 1, 'at least one message');
      assert.ok(
        messages.every((message) => message.request_id === 'node'),
        'every message carries the request_id',
      );
      assert.deepEqual(
        messages.map((message) => message.finished !== null),
        messages.map((_, i) => i === messages.length - 1),
        'only the last message has finished',
      );
      assert.equal(last.finished.finish_reason, 'length', 'finished.finish_reason');
      assert.equal(last.finished.prompt_tokens, PROMPT.length, 'finished.prompt_tokens');
      assert.equal(last.finished.completion_tokens, MAX_TOKENS, 'finished.completion_tokens');
      assert.equal(tokenIds.length, MAX_TOKENS, `streamed token ids ${JSON.stringify(tokenIds)}`);
      assert.ok(
        tokenIds.every((id) => Number.isInteger(id) && id >= 0 && id < 512),
        'token ids are in the vocabulary',
      );
    },
  ],
  [
    'Generate: an empty prompt is INVALID_ARGUMENT with BadRequest on token_ids',
    async () => {
      const request = { request_id: 'empty', token_ids: { ids: [] }, sampling: { max_tokens: MAX_TOKENS } };
      const err = await rejection(serverStream(executor, 'Generate', request), 'Generate');
      summary.bad_request = { code: err.code, message: err.details, violations: badRequestViolations(richStatus(err)) };
      invalidArgument(err, ['token_ids']);
    },
  ],
];

const failures = await runChecks(checks);
executor.close();
health.close();
console.log(JSON.stringify(summary));
process.exitCode = failures ? 1 : 0;
