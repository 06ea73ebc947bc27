// The playground: a chat streamed from /v1/chat/completions with the settings of the left column.
import { stream } from "./api.js";
import { curl, python } from "./snippets.js";

const $ = (id) => document.getElementById(id);

class SettingsError extends Error {}

function parseJson(text, what) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new SettingsError(`${what} is not valid JSON: ${error.message}`);
  }
}

function lines(text) {
  return text
    .split("\n")
    .map((line) => line.trim())
    .filter((line) => line !== "");
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // always text: model output is never parsed as HTML
  return node;
}

export class Playground {
  constructor({ keyRefused, banner }) {
    this.keyRefused = keyRefused;
    this.banner = banner;
    this.history = []; // the conversation so far, as OpenAI messages (the system prompt is added per request)
    this.controller = null; // the running request's AbortController
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop-button").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => {
      this.stop();
      this.history = [];
      $("transcript").replaceChildren();
    });
    $("constraint-kind").addEventListener("change", () => {
      $("constraint").hidden = $("constraint-kind").value === "";
    });
    $("copy-curl").addEventListener("click", () => this.showCode("curl", curl));
    $("copy-python").addEventListener("click", () => this.showCode("openai-python", python));
    $("code-close").addEventListener("click", () => $("code-dialog").close());
    $("code-copy").addEventListener("click", () => copyCode());
  }

  shown() {
    $("prompt").focus();
  }

  hidden() {}

  // The request body for the conversation plus `userText` as the next message (not streamed: the
  // caller adds that). Throws SettingsError when a field cannot be used.
  request(userText) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...this.history);
    if (userText) messages.push({ role: "user", content: userText });
    const body = { model: $("model").value, messages };
    for (const [name, parse] of [
      ["temperature", parseFloat],
      ["top_p", parseFloat],
      ["max_tokens", (v) => parseInt(v, 10)],
      ["seed", (v) => parseInt(v, 10)],
    ]) {
      const raw = $(name).value.trim();
      if (raw === "") continue;
      const value = parse(raw);
      if (Number.isNaN(value)) throw new SettingsError(`${name} is not a number: ${raw}`);
      body[name] = value;
    }
    const stop = lines($("stop").value);
    if (stop.length) body.stop = stop;
    const kind = $("constraint-kind").value;
    const spec = $("constraint").value.trim();
    if (kind && !spec) throw new SettingsError("The constraint box is empty.");
    if (kind === "json_schema") {
      body.response_format = {
        type: "json_schema",
        json_schema: { name: "answer", schema: parseJson(spec, "The JSON schema"), strict: true },
      };
    } else if (kind === "regex") {
      body.guided_regex = spec;
    } else if (kind === "choice") {
      body.guided_choice = lines(spec);
    }
    const tools = $("tools").value.trim();
    if (tools) {
      body.tools = parseJson(tools, "The tool list");
      body.tool_choice = $("tool_choice").value;
    }
    return body;
  }

  showCode(title, render) {
    let text;
    try {
      text = render(this.request($("prompt").value.trim()));
    } catch (error) {
      this.banner(error.message);
      return;
    }
    $("code-title").textContent = title;
    $("code-text").textContent = text;
    $("code-copied").textContent = "";
    $("code-dialog").showModal();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async send() {
    if (this.controller) return; // one reply at a time
    const text = $("prompt").value.trim();
    if (!text) return;
    let body;
    try {
      body = this.request(text);
    } catch (error) {
      this.banner(error.message);
      return;
    }
    this.banner("");
    $("prompt").value = "";
    this.history.push({ role: "user", content: text });
    const user = el("div", "msg user");
    user.append(el("div", "role", "user"), el("div", "content", text));
    $("transcript").append(user);
    await this.reply({ ...body, stream: true, stream_options: { include_usage: true } });
  }

  async reply(body) {
    const node = el("div", "msg assistant");
    const content = el("div", "content");
    const calls = el("div", "tool-calls");
    const meta = el("div", "meta", "…");
    node.append(el("div", "role", "assistant"), content, calls, meta);
    node.dataset.state = "streaming";
    $("transcript").append(node);
    node.scrollIntoView({ block: "end" });

    this.controller = new AbortController();
    $("send").disabled = true;
    $("stop-button").disabled = false;
    const started = performance.now();
    let first = null;
    let last = null;
    let text = "";
    let usage = null;
    let finish = null;
    const toolCalls = []; // by index: {id, name, arguments}
    try {
      await stream(
        "v1/chat/completions",
        body,
        (chunk) => {
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const now = performance.now();
            if (first === null) first = now;
            last = now;
            const delta = choice.delta || {};
            if (delta.content) {
              text += delta.content;
              content.textContent = text;
            }
            for (const call of delta.tool_calls || []) {
              const slot = (toolCalls[call.index] ||= { id: call.id, name: "", arguments: "" });
              if (call.function && call.function.name) slot.name += call.function.name;
              if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
              calls.replaceChildren(...toolCalls.map((c) => el("div", "tool-call", `${c.name}(${c.arguments})`)));
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        },
        this.controller.signal,
      );
      node.dataset.state = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        node.dataset.state = "stopped";
      } else {
        node.dataset.state = "error";
        node.append(el("div", "error", error.message));
        if (error.needsKey) this.keyRefused(error);
      }
    } finally {
      this.controller = null;
      $("send").disabled = false;
      $("stop-button").disabled = true;
    }
    if (text || toolCalls.length) {
      const message = { role: "assistant", content: text };
      if (toolCalls.length) {
        message.tool_calls = toolCalls.map((c) => ({
          id: c.id,
          type: "function",
          function: { name: c.name, arguments: c.arguments },
        }));
      }
      this.history.push(message);
    }
    node.dataset.finishReason = finish || "";
    meta.textContent = describe(node.dataset.state, usage, finish, started, first, last);
    if (usage) {
      node.dataset.promptTokens = usage.prompt_tokens;
      node.dataset.completionTokens = usage.completion_tokens;
    }
    if (first !== null) node.dataset.ttftMs = (first - started).toFixed(1);
  }
}

// The reply's line of numbers: tokens, time to first token (as this browser saw it), decode speed.
function describe(state, usage, finish, started, first, last) {
  const parts = [];
  if (usage) {
    let prompt = `${usage.prompt_tokens} prompt tokens`;
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached) prompt += ` (${cached} cached)`;
    parts.push(prompt, `${usage.completion_tokens} completion tokens`);
  }
  if (first !== null) parts.push(`TTFT ${(first - started).toFixed(0)} ms`);
  if (usage && usage.completion_tokens > 1 && last > first) {
    parts.push(`${(((usage.completion_tokens - 1) * 1000) / (last - first)).toFixed(1)} tok/s`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  if (state === "stopped") parts.push("stopped");
  if (state === "error") parts.push("failed");
  return parts.join(" · ");
}

async function copyCode() {
  const text = $("code-text").textContent;
  try {
    await navigator.clipboard.writeText(text); // only in a secure context (https, or localhost)
    $("code-copied").textContent = "copied";
  } catch (_) {
    const range = document.createRange(); // elsewhere: select it for Ctrl+C
    range.selectNodeContents($("code-text"));
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    $("code-copied").textContent = "selected: press Ctrl+C";
  }
}
