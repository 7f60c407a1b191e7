// The whole specdec flow from Node.js, with @grpc/grpc-js and @grpc/proto-loader reading protos/specdec/v1/*.proto:
//
//   1. GetCapabilities  ask the executor what its machine really runs, GetServerInfo its versions and limits;
//   2. SelectBackends   ask the selector which attention backend the target and the drafter use, and why;
//   3. LoadModel        load a tiny synthetic Llama target (or --target-path) and a synthetic drafter on them;
//   4. Generate         stream a greedy speculative generation, printing tokens as they arrive: token ids, or with
//                       --chat a user message the server renders with the model's chat template; --stop ends it
//                       at a stop string;
//   5. print the acceptance statistics of the final message, and GetLoads: the executor's load.
//
//   npm ci && node client.mjs --selector HOST:PORT --executor HOST:PORT [--method dflash|eagle3]
//
// Addresses are gRPC targets: HOST:PORT, or dns:///NAME:PORT for replicas behind one name (a Kubernetes headless
// service), balanced with round_robin; UNAVAILABLE before any response is retried on the next replica
// (SERVICE_CONFIG). --requests N sends the generation N times, spread over them. With replicas, LoadModel reaches
// one of them: the others must have loaded the same model at start (--load).
// Addresses default to $SPECDEC_SELECTOR and $SPECDEC_EXECUTOR; when $SPECDEC_AUTH_TOKEN is set every call carries
// `authorization: Bearer <token>`. --protos DIR points at another copy of the protos. Exits 1, printing the gRPC
// status, when a call fails, or naming the address and the cause when a server refuses the connection or is not the
// service asked for (its gRPC health service says which specdec service answers there).
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const HERE = path.dirname(fileURLToPath(import.meta.url));

const USAGE = `usage: node client.mjs [--selector HOST:PORT] [--executor HOST:PORT] [--method dflash|eagle3]
                      [--num-speculative-tokens N] [--target-backend NAME] [--drafter-backend NAME]
                      [--max-tokens N] [--prompt "IDS"] [--target-path PATH] [--chat TEXT]
                      [--stop STRING ...] [--requests N] [--protos DIR] [--help]

The whole specdec flow from Node.js: GetCapabilities, SelectBackends, LoadModel, Generate (streamed).
  --selector HOST:PORT         selector address (default $SPECDEC_SELECTOR or 127.0.0.1:50051)
  --executor HOST:PORT         executor address (default $SPECDEC_EXECUTOR or 127.0.0.1:50052)
  --method dflash|eagle3       the drafter's kind (default dflash)
  --num-speculative-tokens N   tokens drafted per step (default 4)
  --target-backend NAME        "auto" or a backend name, e.g. CPU_ATTN (default auto)
  --drafter-backend NAME       the drafter's own; never inherited (default auto)
  --max-tokens N               tokens to generate at most (default 24)
  --prompt "IDS"               token ids, separated by spaces (default "1 2 3 4 5")
  --target-path PATH           a checkpoint under the executor's --model-root to load instead of the synthetic
                               target (a Llama of the same shape, e.g. one with a tokenizer and a chat template)
  --chat TEXT                  send this user message, in the model's chat template, instead of --prompt
  --stop STRING                a stop string (repeatable); needs a tokenizer
  --requests N                 send the generation N times (replicas: spread over them; default 1)
  --protos DIR                 another copy of the protos (default ../../protos)
  -h, --help                   print this and exit
$SPECDEC_AUTH_TOKEN, when set, is sent as \`authorization: Bearer <token>\` on every call.`;

// A bad command line prints the usage and exits 2 (like argparse and Go's flag package); --help exits 0.
function usageError(message) {
  console.error(`${USAGE}\n\nclient.mjs: error: ${message}`);
  process.exit(2);
}

let parsed;
try {
  parsed = parseArgs({
    options: {
      help: { type: 'boolean', short: 'h', default: false },
      selector: { type: 'string', default: process.env.SPECDEC_SELECTOR ?? '127.0.0.1:50051' },
      executor: { type: 'string', default: process.env.SPECDEC_EXECUTOR ?? '127.0.0.1:50052' },
      method: { type: 'string', default: 'dflash' },
      'num-speculative-tokens': { type: 'string', default: '4' },
      'target-backend': { type: 'string', default: 'auto' },
      'drafter-backend': { type: 'string', default: 'auto' },
      'max-tokens': { type: 'string', default: '24' },
      prompt: { type: 'string', default: '1 2 3 4 5' },
      'target-path': { type: 'string' },
      chat: { type: 'string' },
      stop: { type: 'string', multiple: true, default: [] },
      requests: { type: 'string', default: '1' },
      protos: { type: 'string', default: path.resolve(HERE, '..', '..', 'protos') },
    },
  });
} catch (err) {
  if (!err.code?.startsWith('ERR_PARSE_ARGS_')) throw err;
  usageError(err.message);
}
const args = parsed.values;
if (args.help) {
  console.log(USAGE);
  process.exit(0);
}
const METHODS = { dflash: 'SPEC_METHOD_DFLASH', eagle3: 'SPEC_METHOD_EAGLE3' };
if (!(args.method in METHODS)) usageError(`--method must be one of ${Object.keys(METHODS).join(', ')}`);
for (const name of ['num-speculative-tokens', 'max-tokens', 'requests']) {
  if (!/^\d+$/.test(args[name])) usageError(`--${name} must be a whole number, not '${args[name]}'`);
}
if (Number(args.requests) < 1) usageError(`--requests must be at least 1, not ${args.requests}`);
// HOST:PORT with a port in 1..65535 (dns:///NAME:PORT, ipv4:A:P,B:P and unix:PATH targets pass as they are).
for (const role of ['selector', 'executor']) {
  const match = /^(.*[^:]):(\d+)$/.exec(args[role]);
  const port = match ? Number(match[2]) : 1;
  if (port < 1 || port > 65535) usageError(`--${role} '${args[role]}': ${match[2]} is not a port in 1..65535`);
}

// Field names as in the .proto files, enums as their names, 64-bit integers as decimal strings.
const definition = protoLoader.loadSync(['specdec/v1/selector.proto', 'specdec/v1/executor.proto'], {
  keepCase: true,
  enums: String,
  longs: String,
  defaults: true,
  oneofs: true,
  includeDirs: [args.protos],
});
const { specdec } = grpc.loadPackageDefinition(definition);

// The target: a random-weight Llama built from a seed by the executor (no checkpoint to download).
const TINY_LLAMA = {
  architecture: 'llama',
  vocab_size: 512,
  hidden_size: 64,
  intermediate_size: 128,
  num_layers: 2,
  num_heads: 4,
  num_kv_heads: 2,
  head_size: 32,
  seed: 0,
};
// The drafter: random weights too, so its guesses rarely match the target's. With this seed the DFlash and the
// EAGLE-3 drafter each get one token of the default run accepted, so the statistics are not all zero.
const DRAFTER_SEED = 38;
const BLOCK_SIZE = 16; // tokens per KV-cache block
const LOAD_TIMEOUT_MS = 600_000; // a real checkpoint on a GPU takes a while to load and warm up
const CALL_TIMEOUT_MS = 30_000;

// A synthetic drafter of the target's width: DFlash (2 layers, one non-causal block of k+1 positions filled with a
// mask token) or EAGLE-3 (1 layer, its own output vocabulary of half the target's).
function draftModel(method, k) {
  const synthetic = { ...TINY_LLAMA, vocab_size: 0, seed: DRAFTER_SEED }; // vocab_size 0: the target's
  const draft = { method: METHODS[method], num_speculative_tokens: k, source: { synthetic } };
  if (method === 'dflash') {
    synthetic.num_layers = 2;
    draft.dflash_config = { mask_token_id: TINY_LLAMA.vocab_size - 1, block_size: k + 1 };
  } else {
    synthetic.num_layers = 1;
    synthetic.draft_vocab_size = TINY_LLAMA.vocab_size / 2;
  }
  return draft;
}

// What one attention stack needs, as the selector reads it.
function layerSpec(model) {
  return {
    head_size: model.head_size,
    num_heads: model.num_heads,
    num_kv_heads: model.num_kv_heads,
    dtype: 'DTYPE_FLOAT32',
    kv_cache_dtype: 'auto',
    block_size: BLOCK_SIZE,
  };
}

function printDecision(role, decision) {
  const how = decision.explicit ? 'explicit' : 'auto';
  const causality = decision.use_non_causal ? 'non-causal' : 'causal';
  console.log(`${role}: ${decision.backend} (${how}, ${causality})`);
  for (const candidate of decision.candidates) {
    const verdict = candidate.reasons.length ? candidate.reasons.join('; ') : 'ok';
    const selected = candidate.backend === decision.backend ? ' <- selected' : '';
    console.log(`  ${candidate.backend}: ${verdict}${selected}`);
  }
}

function printStatistics(finished) {
  console.log(
    `finished: ${finished.finish_reason}, ${finished.prompt_tokens} prompt tokens, ` +
      `${finished.completion_tokens} completion tokens`,
  );
  const rate = finished.drafted_tokens ? finished.accepted_tokens / finished.drafted_tokens : 0;
  console.log(
    `drafted ${finished.drafted_tokens}, accepted ${finished.accepted_tokens} (${(100 * rate).toFixed(1)}%), ` +
      `mean acceptance length ${finished.mean_acceptance_length.toFixed(3)}`,
  );
  const perPosition = finished.acceptance_rate_per_position.map((r) => r.toFixed(3)).join(' ');
  console.log(`acceptance rate per position: ${perPosition}`);
}

function printLoads(loads) {
  console.log(
    `loads: ${loads.running_requests} running, ${loads.queued_requests} queued, ` +
      `${loads.used_kv_blocks}/${loads.num_kv_blocks} KV blocks used, ${loads.prompt_tokens_total} prompt and ` +
      `${loads.generation_tokens_total} generated tokens in all, ` +
      `${loads.generation_tokens_per_second.toFixed(1)} tokens/s`,
  );
}

// What answers at an address, asked of its gRPC health service (open to callers without a token): the two specdec
// services register their names there.
const SERVICES = { executor: 'specdec.v1.Executor', selector: 'specdec.v1.BackendSelector' };
const CONNECT_TIMEOUT_MS = 10_000; // an address that neither accepts nor refuses (a dropped SYN) is given up after this

// A client's failure to reach its server, or to find the service asked for there: one line, exit 1.
class Unreachable extends Error {}

// grpc.health.v1.Health/Check of `service`, encoded by hand (a HealthCheckRequest is one string field) so this
// example needs no health protos; resolves to null when the server registers the service, else to the gRPC error.
function healthCheck(client, service) {
  const name = Buffer.from(service);
  const request = Buffer.concat([Buffer.from([0x0a, name.length]), name]);
  return new Promise((resolve) => {
    client.makeUnaryRequest(
      '/grpc.health.v1.Health/Check',
      (bytes) => bytes,
      (bytes) => bytes,
      request,
      new grpc.Metadata(),
      { deadline: Date.now() + CALL_TIMEOUT_MS },
      (err) => resolve(err ?? null),
    );
  });
}

// Wait for the channel to connect (a refused address fails at its first TRANSIENT_FAILURE, not at a deadline),
// then check that the `role` service answers there; throws Unreachable naming the address, the flag and the cause.
async function connect(client, role) {
  const address = args[role];
  const flag = `--${role} / $SPECDEC_${role.toUpperCase()}`;
  const channel = client.getChannel();
  const deadline = Date.now() + CONNECT_TIMEOUT_MS;
  let state = channel.getConnectivityState(true);
  while (state !== grpc.connectivityState.READY && state !== grpc.connectivityState.TRANSIENT_FAILURE) {
    const changed = await new Promise((resolve) => channel.watchConnectivityState(state, deadline, resolve));
    if (changed) break; // the deadline passed
    state = channel.getConnectivityState(false);
  }
  if (state !== grpc.connectivityState.READY) {
    const err = await healthCheck(client, SERVICES[role]); // without waiting: its UNAVAILABLE says why
    const cause = err ? `${grpc.status[err.code]}: ${err.details}` : 'it did not connect in time';
    throw new Unreachable(`cannot reach the ${role} at ${address} (${flag}): ${cause}`);
  }
  const notFound = (err) => err?.code === grpc.status.NOT_FOUND;
  if (notFound(await healthCheck(client, SERVICES[role]))) {
    const others = [];
    for (const [other, name] of Object.entries(SERVICES)) {
      if ((await healthCheck(client, name)) === null) others.push(`${name} (a specdec ${other})`);
    }
    const there = others.join(' and ') || 'neither specdec service';
    throw new Unreachable(
      `the ${role} at ${address} (${flag}) is not a specdec ${role}: its health service names ${there} there, ` +
        `not ${SERVICES[role]}`,
    );
  }
}

// A unary call as a promise. waitForReady: servers that are still starting (docker compose up) are waited for.
function unary(client, method, request, metadata, timeoutMs = CALL_TIMEOUT_MS) {
  return new Promise((resolve, reject) => {
    const options = { deadline: Date.now() + timeoutMs, waitForReady: true };
    client[method](request, metadata, options, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Client-side load balancing over every address the target resolves to, and gRPC retries of UNAVAILABLE for the
// calls that are safe to repeat. gRPC commits a call at its first response, so a Generate is retried only while it
// has produced no tokens (a replica shutting down or gone). The Python and Go examples set the same config.
const SERVICE_CONFIG = JSON.stringify({
  loadBalancingConfig: [{ round_robin: {} }],
  methodConfig: [
    {
      name: [
        { service: 'specdec.v1.BackendSelector' },
        ...['Generate', 'GetCapabilities', 'GetModelInfo', 'GetServerInfo', 'GetLoads'].map((method) => ({
          service: 'specdec.v1.Executor',
          method,
        })),
      ],
      retryPolicy: {
        maxAttempts: 5,
        initialBackoff: '0.02s',
        maxBackoff: '0.2s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['UNAVAILABLE'],
      },
    },
  ],
});
const CHANNEL_OPTIONS = { 'grpc.service_config': SERVICE_CONFIG, 'grpc.enable_retries': 1 };

async function run(metadata) {
  const credentials = grpc.credentials.createInsecure();
  const executor = new specdec.v1.Executor(args.executor, credentials, CHANNEL_OPTIONS);
  const selector = new specdec.v1.BackendSelector(args.selector, credentials, CHANNEL_OPTIONS);
  try {
    await connect(executor, 'executor');
    await connect(selector, 'selector');
    const hardware = await unary(executor, 'GetCapabilities', {}, metadata);
    const libraries = hardware.libraries.map((lib) => `${lib.name} ${lib.version}`).join(', ');
    console.log(`executor ${args.executor}: ${hardware.platform} ${hardware.device_name} (${libraries})`);
    const server = await unary(executor, 'GetServerInfo', {}, metadata);
    console.log(
      `server: specdec ${server.server_version}, torch ${server.torch_version}, grpc ${server.grpc_version}, ` +
        `max batch ${server.max_batch_size}, max queued ${server.max_queued_requests}`,
    );

    const draft = draftModel(args.method, Number(args['num-speculative-tokens']));
    const selection = await unary(
      selector,
      'SelectBackends',
      {
        hardware,
        target_layers: layerSpec(TINY_LLAMA),
        attention: { backend: args['target-backend'] },
        speculative: {
          method: draft.method,
          num_speculative_tokens: draft.num_speculative_tokens,
          attention_backend: args['drafter-backend'],
          draft_layers: layerSpec(draft.source.synthetic),
          dflash_config: draft.dflash_config,
        },
      },
      metadata,
    );
    console.log(`selector ${args.selector} decided:`);
    printDecision('target', selection.target);
    printDecision('drafter', selection.drafter);

    // Load with the selector's choices named explicitly: the executor validates them and never falls back.
    const load = {
      target: args['target-path'] ? { path: args['target-path'] } : { synthetic: TINY_LLAMA },
      draft: { ...draft, attention_backend: selection.drafter.backend },
      dtype: 'DTYPE_FLOAT32',
      attention: { backend: selection.target.backend },
      block_size: BLOCK_SIZE,
      num_kv_blocks: 64,
    };
    console.log(`loading ${args['target-path'] ?? 'a synthetic llama target'} and a ${args.method} drafter ...`);
    const started = performance.now();
    const loaded = await unary(executor, 'LoadModel', load, metadata, LOAD_TIMEOUT_MS);
    console.log(
      `loaded in ${((performance.now() - started) / 1000).toFixed(2)} s: target ${loaded.target_backend.backend}, ` +
        `drafter ${loaded.draft_backend.backend}, ${loaded.info.num_kv_blocks} KV blocks of ` +
        `${loaded.info.block_size} tokens`,
    );

    const request = {
      request_id: `node-client-${process.pid}`,
      sampling: { temperature: 0, max_tokens: Number(args['max-tokens']), stop: args.stop },
    };
    if (args.chat !== undefined) {
      // The server renders it with the model's chat template.
      request.messages = { messages: [{ role: 'user', content: args.chat }] };
      console.log(`generating up to ${args['max-tokens']} tokens after the chat message ${JSON.stringify(args.chat)}:`);
    } else {
      const prompt = args.prompt.trim().split(/\s+/).map(Number);
      request.token_ids = { ids: prompt };
      console.log(`generating up to ${args['max-tokens']} tokens after the prompt ${prompt.join(' ')}:`);
    }
    let finished = null;
    let text = '';
    // Server streaming: a readable stream of GenerateResponse; a failed call throws out of the loop.
    for await (const response of executor.Generate(request, metadata)) {
      if (response.token_ids.length) {
        const tokens = response.token_ids.join(' ');
        console.log(`  + ${tokens} (drafted ${response.num_drafted}, accepted ${response.num_accepted})`);
      }
      text += response.text; // empty without a tokenizer
      if (response.finished) finished = response.finished;
    }
    if (!finished) throw new Error('the stream ended without a final message');
    if (text) console.log(`text: ${JSON.stringify(text)}`);
    printStatistics(finished);
    const requests = Number(args.requests);
    for (let number = 2; number <= requests; number++) {
      // The same request again: round_robin sends it to the next replica.
      request.request_id = `node-client-${process.pid}-${number}`;
      let tokens = 0;
      let reason = '';
      for await (const response of executor.Generate(request, metadata)) {
        tokens += response.token_ids.length;
        if (response.finished) reason = response.finished.finish_reason;
      }
      console.log(`request ${number} of ${requests}: ${tokens} tokens, ${reason}`);
    }
    printLoads(await unary(executor, 'GetLoads', {}, metadata));
  } finally {
    executor.close();
    selector.close();
  }
}

const metadata = new grpc.Metadata();
if (process.env.SPECDEC_AUTH_TOKEN) metadata.add('authorization', `Bearer ${process.env.SPECDEC_AUTH_TOKEN}`);
try {
  await run(metadata);
} catch (err) {
  if (err instanceof Unreachable) {
    console.error(`error: ${err.message}`);
    process.exit(1);
  }
  if (err.code === undefined) throw err; // not a gRPC status: a bug, with its stack
  console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
  process.exitCode = 1;
}
