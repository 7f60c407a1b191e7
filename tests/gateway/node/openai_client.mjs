// The official `openai` npm package against a running specdec-gateway: non-stream and stream chat, completions,
// logprobs, stop strings, seeds and the errors the SDK raises. Prints one JSON object (what the Python test checks
// against the gateway's answers to the Python SDK); exits 1 with the failed check on stderr.
//   node openai_client.mjs BASE_URL TOKEN MODEL
import OpenAI from "openai";

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const messages = [{ role: "system", content: "be brief" }, { role: "user", content: "hello there" }];
const greedy = { model, messages, temperature: 0, max_tokens: 24 };

function check(condition, what) {
  if (!condition) {
    console.error(`check failed: ${what}`);
    process.exit(1);
  }
}

async function status(call) {
  try {
    await call();
  } catch (err) {
    if (err instanceof OpenAI.APIError) return { status: err.status, param: err.param ?? null, code: err.code };
    throw err;
  }
  return { status: 200 };
}

const whole = await client.chat.completions.create(greedy);
const text = whole.choices[0].message.content;
check(whole.usage.speculative.drafted_tokens > 0, "usage.speculative.drafted_tokens > 0");

let streamed = "";
let usage = null;
const stream = await client.chat.completions.create({ ...greedy, stream: true, stream_options: { include_usage: true } });
for await (const chunk of stream) {
  if (chunk.choices.length) streamed += chunk.choices[0].delta.content ?? "";
  else usage = chunk.usage;
}
check(streamed === text, "the stream joins to the non-streamed answer");
check(usage && usage.completion_tokens === whole.usage.completion_tokens, "the stream's usage chunk");

const withLogprobs = await client.chat.completions.create({ ...greedy, logprobs: true, top_logprobs: 2 });
const entries = withLogprobs.choices[0].logprobs.content;
check(entries.length === withLogprobs.usage.completion_tokens, "one logprob per token");
check(entries.every((e) => e.top_logprobs.length === 2 && e.top_logprobs[0].token === e.token), "top logprobs");

const prompt = { model, prompt: "abc", temperature: 0, max_tokens: 24, ignore_eos: true };
const free = (await client.completions.create(prompt)).choices[0].text;
const stop = free.slice(6, 9);
const stopped = (await client.completions.create({ ...prompt, stop: [stop] })).choices[0];
check(stopped.text === free.slice(0, free.indexOf(stop)) && stopped.finish_reason === "stop", "the stop string");

const sampled = async (seed) =>
  (await client.chat.completions.create({ model, messages, temperature: 1, seed, max_tokens: 16 })).choices[0].message
    .content;
check((await sampled(7)) === (await sampled(7)), "the same seed, the same text");

const errors = {
  bad_temperature: await status(() => client.chat.completions.create({ ...greedy, temperature: -1 })),
  n: await status(() => client.chat.completions.create({ ...greedy, n: 129 })),
  wrong_model: await status(() => client.chat.completions.create({ ...greedy, model: "gpt-4o" })),
  wrong_key: await status(() =>
    new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).chat.completions.create(greedy),
  ),
};
const models = (await client.models.list()).data.map((m) => m.id);
console.log(JSON.stringify({ text, streamed, completion: free, models, errors }));
