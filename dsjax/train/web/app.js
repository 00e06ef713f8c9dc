// A small client for the OpenAI-compatible HTTP API of `dsjax serve`.
"use strict";

const API = "/v1/chat/completions";

function el(id) {
  return document.getElementById(id);
}

async function* streamChat(messages, { model = "dsjax", maxTokens = 128, temperature = 0 } = {}) {
  const response = await fetch(API, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model, messages, max_tokens: maxTokens, temperature, stream: true }),
  });
  if (!response.ok) {
    throw new Error(`request failed: ${response.status} ${response.statusText}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      const delta = chunk.choices[0].delta;
      if (delta && delta.content) yield delta.content;
    }
  }
}

el("prompt-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const output = el("output");
  output.textContent = "";
  const prompt = el("prompt").value.trim();
  if (!prompt) {
    output.textContent = "Please enter a prompt.";
    return;
  }
  try {
    for await (const piece of streamChat([{ role: "user", content: prompt }])) {
      output.textContent += piece;
    }
  } catch (err) {
    output.textContent = `Error: ${err.message}`;
  }
});
