// The Vercel AI SDK's `embed` and `embedMany` against mlxhost, unmodified: the OpenAI provider
// with a base URL. Run by tests/e2e/test_embeddings_sdk.py with the SDK from .cache/ai-sdk
// (scripts/ai_sdk.sh); prints one JSON line with what came back.
// Usage: node embed.mjs BASE_URL API_KEY MODEL
import { createRequire } from "node:module";
import path from "node:path";

const [baseURL, apiKey, model] = process.argv.slice(2);
const sdk = createRequire(path.join(process.env.AI_SDK_PREFIX, "node_modules", "index.js"));
const { embed, embedMany, cosineSimilarity } = await import(sdk.resolve("ai"));
const { createOpenAI } = await import(sdk.resolve("@ai-sdk/openai"));

const openai = createOpenAI({ baseURL, apiKey });
const one = await embed({ model: openai.embedding(model), value: "The cat sits on the mat.", maxRetries: 0 });
const many = await embedMany({
  model: openai.embedding(model),
  values: ["A cat is sitting on a rug.", "The stock market fell sharply today."],
  maxRetries: 0,
});
console.log(
  JSON.stringify({
    single: { length: one.embedding.length, tokens: one.usage.tokens },
    many: { count: many.embeddings.length, length: many.embeddings[0].length, tokens: many.usage.tokens },
    similar: cosineSimilarity(one.embedding, many.embeddings[0]),
    dissimilar: cosineSimilarity(one.embedding, many.embeddings[1]),
  }),
);
