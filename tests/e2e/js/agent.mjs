// The Vercel AI SDK's `generateText` with tools and a typed result (`output: Output.object`)
// against mlxhost, unmodified: the OpenAI provider's chat model with a base URL. Run by
// tests/e2e/test_agent_outputs.py with the SDK from .cache/ai-sdk (scripts/ai_sdk.sh); prints
// one JSON line: the tool's calls, the typed output, and each step's finish reason.
// Usage: node agent.mjs BASE_URL API_KEY MODEL MODE
// MODE "forced": the first step must call the tool (`toolChoice: "required"`), later steps may
// not (`"none"`, the SDK's own recipe for a final answer); "auto": every step chooses.
import { createRequire } from "node:module";
import path from "node:path";

const [baseURL, apiKey, model, mode] = process.argv.slice(2);
const sdk = createRequire(path.join(process.env.AI_SDK_PREFIX, "node_modules", "index.js"));
const { generateText, Output, tool, stepCountIs } = await import(sdk.resolve("ai"));
const { createOpenAI } = await import(sdk.resolve("@ai-sdk/openai"));
const { z } = await import(sdk.resolve("zod"));

const calls = [];
const openai = createOpenAI({ baseURL, apiKey });
const result = await generateText({
  model: openai.chat(model),
  system: "Use the tool, then answer with the forecast.",
  prompt: "Weather in Oslo for 2 days?",
  tools: {
    get_weather: tool({
      description: "The forecast for a city.",
      inputSchema: z.object({ city: z.string().max(16), days: z.number().int().min(1).max(7) }),
      execute: async ({ city, days }) => {
        calls.push({ city, days });
        return `Sunny in ${city} for ${days} days`;
      },
    }),
  },
  toolChoice: "auto",
  prepareStep: ({ stepNumber }) =>
    mode === "forced" ? { toolChoice: stepNumber === 0 ? "required" : "none" } : {},
  output: Output.object({
    schema: z.object({ city: z.string().max(16), sunny: z.boolean() }),
  }),
  stopWhen: stepCountIs(4),
  maxOutputTokens: 80,
  temperature: 0,
  maxRetries: 0,
});
console.log(
  JSON.stringify({
    calls,
    output: result.output,
    steps: result.steps.map((step) => step.finishReason),
  }),
);
