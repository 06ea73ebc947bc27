// The app's frame: tabs (#playground, #dashboard), the key dialog, the banner and the model list.
import { call, keys } from "./api.js";
import { Playground } from "./playground.js";
import { Dashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);

// ---- keys ----------------------------------------------------------------------------------------
let pendingKey = null; // one dialog at a time: a second caller waits for the same answer

// Ask for a key ("user" or "admin"); resolves true once one is stored, false if the dialog was cancelled.
function askForKey(kind, reason) {
  if (pendingKey) return pendingKey;
  const dialog = $("key-dialog");
  $("key-title").textContent = kind === "admin" ? "Admin key" : "API key";
  $("key-reason").textContent = reason || "";
  $("key-input").value = "";
  dialog.dataset.kind = kind;
  pendingKey = new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        pendingKey = null;
        const value = $("key-input").value.trim();
        const ok = dialog.returnValue === "ok" && value !== "";
        if (ok) keys.set(kind, value);
        showKeyState();
        resolve(ok);
      },
      { once: true },
    );
  });
  dialog.returnValue = "";
  dialog.showModal();
  return pendingKey;
}

function showKeyState() {
  $("key-state").textContent = keys.user() ? "key set" : "";
}

function banner(text) {
  const el = $("banner");
  el.textContent = text || "";
  el.hidden = !text;
}

// ---- the models, which also tells whether the key works --------------------------------------------
async function connect() {
  try {
    const models = await call("v1/models");
    const select = $("model");
    select.replaceChildren(
      ...models.data.map((m) => {
        const option = document.createElement("option");
        option.value = option.textContent = m.id;
        return option;
      }),
    );
    const first = models.data[0];
    $("model-info").textContent = first ? `${first.id} · context ${first.max_model_len} tokens` : "";
    banner("");
    document.body.dataset.connected = "true";
    return true;
  } catch (error) {
    document.body.dataset.connected = "false";
    if (error.needsKey) {
      banner(`This server needs an API key: ${error.message}`);
      if (await askForKey("user", error.message)) return connect();
    } else {
      banner(`The server does not answer: ${error.message}`);
    }
    return false;
  }
}

// Called by the pages when a request was refused for want of a key: ask, then say whether to retry.
async function keyRefused(error) {
  banner(`This server needs an API key: ${error.message}`);
  if (!(await askForKey("user", error.message))) return false;
  return connect();
}


// ---- tabs ----------------------------------------------------------------------------------------
const pages = {};

function showTab() {
  const name = location.hash === "#dashboard" ? "dashboard" : "playground";
  for (const [key, page] of Object.entries(pages)) {
    $(key).hidden = key !== name;
    $(`tab-${key}`).classList.toggle("active", key === name);
    if (key === name) page.shown();
    else page.hidden();
  }
}

$("key-button").addEventListener("click", async () => {
  if (await askForKey("user", "Replace the key this tab sends (leave empty and Cancel to keep it).")) connect();
});

pages.playground = new Playground({ keyRefused, banner });
pages.dashboard = new Dashboard({ keyRefused, askForKey, banner });
window.addEventListener("hashchange", showTab);
showKeyState();
showTab();
connect();
