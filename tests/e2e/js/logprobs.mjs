// The OpenAI Node SDK's chat.completions.create with logprobs under a grammar (a json_schema, a
// forced tool, a schema with a regex pattern), whole and streamed, unmodified. The SDK parses each
// body with JSON.parse, which refuses NaN and -Infinity. Run by tests/e2e/test_openai_node_sdk.py
// with the SDK from .cache/openai-node (scripts/openai_node.sh); prints one JSON line per case.
// Usage: node logprobs.mjs BASE_URL API_KEY MODEL
import { createRequire } from "node:module";
import path from "node:path";

const [baseURL, apiKey, model] = process.argv.slice(2);
const sdk = createRequire(path.join(process.env.OPENAI_NODE_PREFIX, "node_modules", "index.js"));
const { default: OpenAI } = await import(sdk.resolve("openai"));
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });

const person = {
  type: "object",
  properties: { name: { type: "string", maxLength: 12 }, age: { type: "integer", minimum: 0, maximum: 99 } },
  required: ["name", "age"],
  additionalProperties: false,
};
const code = {
  type: "object",
  properties: { code: { type: "string", pattern: "^[A-Z]{3}-[0-9]{2}$" } },
  required: ["code"],
  additionalProperties: false,
};
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 16 } },
      required: ["city"],
      additionalProperties: false,
    },
  },
};
const base = { model, messages: [{ role: "user", content: "Answer." }], max_tokens: 40, logprobs: true, top_logprobs: 20 };
const cases = {
  json_schema: { ...base, response_format: { type: "json_schema", json_schema: { name: "person", schema: person } } },
  forced_tool: { ...base, tools: [weather], tool_choice: { type: "function", function: { name: "get_weather" } } },
  pattern: { ...base, response_format: { type: "json_schema", json_schema: { name: "code", schema: code } } },
};

async function whole(body) {
  const completion = await client.chat.completions.create(body);
  const choice = completion.choices[0];
  return {
    text: choice.message.content,
    arguments: choice.message.tool_calls?.[0]?.function.arguments ?? null,
    logprobs: choice.logprobs?.content ?? [],
  };
}

async function streamed(body) {
  const stream = await client.chat.completions.create({ ...body, stream: true });
  let text = "";
  let args = null;
  const logprobs = [];
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    text += choice.delta?.content ?? "";
    for (const call of choice.delta?.tool_calls ?? []) args = (args ?? "") + (call.function?.arguments ?? "");
    logprobs.push(...(choice.logprobs?.content ?? []));
  }
  return { text: text || null, arguments: args, logprobs };
}

for (const [name, body] of Object.entries(cases)) {
  for (const [how, run] of [["whole", whole], ["streamed", streamed]]) {
    try {
      const got = await run(body);
      const values = got.logprobs.flatMap((e) => [e.logprob, ...e.top_logprobs.map((t) => t.logprob)]);
      console.log(
        JSON.stringify({
          case: name,
          how,
          ok: true,
          text: got.text,
          arguments: got.arguments,
          tokens: got.logprobs.length,
          joined: got.logprobs.map((e) => e.token).join(""),
          alternatives: got.logprobs.map((e) => e.top_logprobs.length),
          finite: values.every((v) => Number.isFinite(v)),
        }),
      );
    } catch (error) {
      console.log(JSON.stringify({ case: name, how, ok: false, error: String(error?.message ?? error) }));
    }
  }
}
