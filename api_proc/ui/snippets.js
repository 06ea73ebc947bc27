// "Copy as curl / openai-python": the playground's current request as a command or a script.
import { absoluteUrl, keys } from "./api.js";

// Fields OpenAI's SDK does not know: they go in extra_body.
const EXTRA_FIELDS = new Set(["guided_regex", "guided_choice", "guided_json", "guided_grammar"]);

function shellQuote(text) {
  return `'${text.replace(/'/g, `'\\''`)}'`;
}

export function curl(body) {
  const lines = [`curl ${shellQuote(absoluteUrl("v1/chat/completions"))}`, `-H 'Content-Type: application/json'`];
  if (keys.user()) lines.push(`-H "Authorization: Bearer $PAGODA_API_KEY"`); // the key itself stays out of the clipboard
  lines.push(`-d ${shellQuote(JSON.stringify(body, null, 2))}`);
  return lines.join(" \\\n  ");
}

// A Python literal for a JSON value (True/False/None; strings as JSON escapes them, which Python reads).
function py(value, indent = "") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  const inner = indent + "    ";
  if (Array.isArray(value)) {
    if (value.length === 0) return "[]";
    return `[\n${value.map((v) => inner + py(v, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (entries.length === 0) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${py(v, inner)}`).join(",\n")},\n${indent}}`;
}

export function python(body) {
  const args = [];
  const extra = {};
  for (const [name, value] of Object.entries(body)) {
    if (EXTRA_FIELDS.has(name)) extra[name] = value;
    else args.push(`    ${name}=${py(value, "    ")},`);
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, "    ")},`);
  const apiKey = keys.user() ? `os.environ["PAGODA_API_KEY"]` : `"unused"`;
  return [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(absoluteUrl("v1"))}, api_key=${apiKey})`,
    "reply = client.chat.completions.create(",
    ...args,
    ")",
    "print(reply.choices[0].message)",
    "print(reply.usage)",
  ].join("\n");
}
