// Talking to the server: relative URLs (the page may sit behind a proxy at a sub-path), the API key
// from this tab's sessionStorage (never localStorage: it must not outlive the browser session), and
// OpenAI's error bodies turned into exceptions with the server's own message.

const USER_KEY = "pagoda.apiKey";
const ADMIN_KEY = "pagoda.adminKey";

export const keys = {
  user: () => sessionStorage.getItem(USER_KEY),
  admin: () => sessionStorage.getItem(ADMIN_KEY),
  set(kind, value) {
    const name = kind === "admin" ? ADMIN_KEY : USER_KEY;
    if (value) sessionStorage.setItem(name, value);
    else sessionStorage.removeItem(name);
  },
};

export class ApiError extends Error {
  constructor(status, body) {
    const error = body && body.error ? body.error : {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
  }
  get needsKey() {
    return this.status === 401;
  }
}

// The absolute URL of a server route, for code snippets (fetch takes the relative one).
export function absoluteUrl(path) {
  return new URL(path, document.baseURI).href;
}

function headers(kind) {
  const h = { "Content-Type": "application/json" };
  const key = kind === "admin" ? keys.admin() : keys.user();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function raiseFor(response) {
  if (response.ok) return;
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    // not JSON: the status says enough
  }
  throw new ApiError(response.status, body);
}

// GET or POST a JSON route; `kind` "admin" sends the admin key.
export async function call(path, { method = "GET", body, kind = "user", signal } = {}) {
  const response = await fetch(path, {
    method,
    headers: headers(kind),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  await raiseFor(response);
  return response.json();
}

// POST a streaming request; calls onEvent(parsed JSON) per server-sent event until [DONE].
// Aborting `signal` closes the connection, which aborts the request in the engine.
export async function stream(path, body, onEvent, signal) {
  const response = await fetch(path, { method: "POST", headers: headers("user"), body: JSON.stringify(body), signal });
  await raiseFor(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(500, parsed); // an error after the stream began
        onEvent(parsed);
      }
    }
  }
}
