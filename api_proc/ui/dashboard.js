// The dashboard: GET dashboard.json once a second while the tab is shown (detok_proc/dashboard.py
// says what it holds). Cards show /metrics' own numbers summed over engine replicas (each card's
// data-sample names the /metrics sample); rates and percentiles come computed from the server.
import { call } from "./api.js";
import { Timeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 1000;

function sum(report, name) {
  return report.engines.reduce((total, e) => total + (e.metrics[name] || 0), 0);
}

const integer = (v) => Math.round(v).toLocaleString("en-US");
const percent = (v) => (v === null || Number.isNaN(v) ? "–" : `${(100 * v).toFixed(1)} %`);
const ms = (seconds) => (seconds === null || seconds === undefined ? "–" : `${(seconds * 1000).toFixed(1)}`);
const rate = (v) => (v === null || v === undefined ? "–" : v.toFixed(1));
const bytes = (v) => `${(v / 2 ** 30).toFixed(2)} GiB`;

// The rate series summed over replicas: {t, prompt_tokens: [...], generation_tokens: [...], ...}.
function totalRates(rates) {
  const out = { t: rates.t };
  for (const name of Object.keys(rates.engines[0] || {})) {
    out[name] = rates.t.map((_, i) => rates.engines.reduce((s, e) => s + e[name][i], 0));
  }
  return out;
}

// Of the rate series: the ratio of two counters' increases over the last `seconds`.
function recentRatio(rates, numerator, denominator, seconds) {
  let num = 0;
  let den = 0;
  for (let i = 1; i < rates.t.length; i++) {
    if (rates.t[i] < -seconds) continue;
    const dt = rates.t[i] - rates.t[i - 1];
    num += rates[numerator][i] * dt;
    den += rates[denominator][i] * dt;
  }
  return den > 0 ? num / den : null;
}

const last = (series) => (series && series.length ? series[series.length - 1] : null);

// Each card: its label, the /metrics sample it sums (if it is one), its value, and a line under it.
const CARDS = [
  { id: "running", label: "Running", sample: "vllm:num_requests_running", format: integer },
  { id: "waiting", label: "Waiting", sample: "vllm:num_requests_waiting", format: integer },
  {
    id: "kv_cache_usage",
    label: "KV cache usage",
    value: (r) => sum(r, "vllm:kv_cache_usage_perc") / Math.max(r.engines.length, 1),
    format: percent,
    sub: (r) => (r.engines.length > 1 ? "mean over replicas" : ""),
  },
  { id: "preemptions", label: "Preemptions", sample: "vllm:num_preemptions_total", format: integer },
  {
    id: "prefix_hit_rate",
    label: "Prefix cache hit rate",
    value: (r) => {
      const queries = sum(r, "vllm:prefix_cache_queries_total");
      return queries > 0 ? sum(r, "vllm:prefix_cache_hits_total") / queries : null;
    },
    format: percent,
    sub: (r, totals) => `last minute: ${percent(recentRatio(totals, "prefix_cache_hits", "prefix_cache_queries", 60))}`,
  },
  {
    id: "generation_rate",
    label: "Generation tok/s",
    value: (r, totals) => last(totals.generation_tokens),
    format: rate,
    sub: (r, totals) => `prompt: ${rate(last(totals.prompt_tokens))} tok/s`,
  },
  { id: "prompt_tokens", label: "Prompt tokens", sample: "vllm:prompt_tokens_total", format: integer },
  { id: "generation_tokens", label: "Generation tokens", sample: "vllm:generation_tokens_total", format: integer },
  { id: "requests", label: "Requests finished", sample: "vllm:request_success_total", format: integer },
  {
    id: "aborted",
    label: "Aborted",
    value: (r) => r.server["pagoda:request_aborted_total"] || 0,
    format: integer,
    sub: (r) =>
      `rejected ${integer(r.server["pagoda:request_rejected_total"] || 0)} · ` +
      `timed out ${integer(r.server["pagoda:request_timeout_total"] || 0)}`,
  },
  {
    id: "engines_up",
    label: "Engine replicas up",
    sample: "pagoda:engine_up",
    format: integer,
    sub: (r) => `of ${r.engines.length}`,
  },
];

export class Dashboard {
  constructor({ askForKey, banner }) {
    this.askForKey = askForKey;
    this.banner = banner;
    this.timer = null;
    this.visible = false;
    this.refreshes = 0;
    this.chart = null;
    this.timeline = new Timeline($("timeline"), $("timeline-info"));
    this.cards = {};
    for (const card of CARDS) {
      const node = document.createElement("div");
      node.className = "card";
      node.dataset.card = card.id;
      if (card.sample) node.dataset.sample = card.sample;
      const label = document.createElement("div");
      label.className = "label";
      label.textContent = card.label;
      const value = document.createElement("div");
      value.className = "value";
      value.textContent = "–";
      const sub = document.createElement("div");
      sub.className = "sub";
      node.append(label, value, sub);
      $("cards").append(node);
      this.cards[card.id] = { node, value, sub };
    }
    $("reset-prefix-cache").addEventListener("click", () => this.resetPrefixCache());
    window.addEventListener("resize", () => this.resize());
  }

  shown() {
    this.visible = true;
    if (this.timer === null) this.tick();
  }

  hidden() {
    this.visible = false;
    clearTimeout(this.timer);
    this.timer = null;
  }

  async tick() {
    try {
      this.render(await call("dashboard.json"));
    } catch (error) {
      $("dash-status").textContent = error.needsKey
        ? `This server needs an API key: ${error.message}`
        : `No data: ${error.message}`;
      $("dash-status").classList.add("failing");
    }
    // The next poll a second after this one ended: a slow server is never asked twice at once.
    this.timer = this.visible ? setTimeout(() => this.tick(), REFRESH_MS) : null;
  }

  render(report) {
    const totals = totalRates(report.rates);
    for (const card of CARDS) {
      const value = card.sample ? sum(report, card.sample) : card.value(report, totals);
      const { node, value: valueNode, sub } = this.cards[card.id];
      node.dataset.value = value === null || value === undefined ? "" : String(value);
      valueNode.textContent = value === null || value === undefined ? "–" : card.format(value);
      sub.textContent = card.sub ? card.sub(report, totals) : "";
    }
    this.renderLatency(report.latency);
    this.renderReplicas(report);
    this.renderRates(totals);
    this.timeline.draw(report.timeline);
    this.refreshes += 1;
    const dashboard = $("dashboard");
    dashboard.dataset.refreshes = String(this.refreshes);
    $("dash-status").textContent = `${report.model} · updated ${new Date().toLocaleTimeString()}`;
    $("dash-status").classList.remove("failing");
  }

  renderLatency(latency) {
    const rows = [["", ["", "count", "mean ms", "p50 ms", "p90 ms", "p99 ms"]]];
    const names = { ttft: "TTFT", itl: "ITL", e2e: "end to end" };
    for (const [kind, name] of Object.entries(names)) {
      const s = latency[kind];
      rows.push([kind, [name, integer(s.count), ms(s.mean), ms(s.p50), ms(s.p90), ms(s.p99)]]);
      for (const [engine, e] of (s.by_engine || []).entries()) {
        const cells = [`engine ${engine}`, integer(e.count), ms(e.mean), ms(e.p50), ms(e.p90), ms(e.p99)];
        rows.push([`${kind}-${engine}`, cells]);
      }
    }
    fillTable($("latency"), rows);
  }

  renderReplicas(report) {
    const gpu = report.engines.some((e) => e.metrics["pagoda:device_memory_total_bytes"]);
    const header = ["engine", "up", "running", "waiting", "KV cache", "preemptions", "prefix hits", "prompt tok/s", "gen tok/s"];
    if (gpu) header.push("GPU memory");
    const rows = [["", header]];
    for (const e of report.engines) {
      const m = e.metrics;
      const series = report.rates.engines[e.engine];
      const queries = m["vllm:prefix_cache_queries_total"] || 0;
      const row = [
        String(e.engine),
        m["pagoda:engine_up"] ? "yes" : "no",
        integer(m["vllm:num_requests_running"] || 0),
        integer(m["vllm:num_requests_waiting"] || 0),
        percent(m["vllm:kv_cache_usage_perc"] || 0),
        integer(m["vllm:num_preemptions_total"] || 0),
        queries ? percent((m["vllm:prefix_cache_hits_total"] || 0) / queries) : "–",
        rate(last(series.prompt_tokens)),
        rate(last(series.generation_tokens)),
      ];
      if (gpu) {
        const used = m["pagoda:device_memory_used_bytes"] || 0;
        const total = m["pagoda:device_memory_total_bytes"] || 0;
        row.push(total ? `${bytes(used)} of ${bytes(total)}` : "–");
      }
      rows.push([`engine-${e.engine}`, row]);
    }
    fillTable($("replicas"), rows);
  }

  renderRates(totals) {
    const data = [totals.t, totals.prompt_tokens || [], totals.generation_tokens || []];
    if (this.chart === null) {
      const holder = $("rate-chart");
      this.chart = new uPlot(
        {
          width: Math.max(holder.clientWidth, 300),
          height: 240,
          scales: { x: { time: false, range: [-300, 0] }, y: { range: (u, min, max) => [0, Math.max(max, 1) * 1.1] } },
          axes: [{ label: "seconds ago", values: (u, ticks) => ticks.map((t) => `${-t}`) }, { label: "tokens/s" }],
          series: [
            { label: "seconds ago", value: (u, v) => (v === null ? "–" : (-v).toFixed(0)) },
            { label: "prompt", stroke: "#d9822b", width: 2, value: (u, v) => rate(v) },
            { label: "generation", stroke: "#2b6cd9", width: 2, value: (u, v) => rate(v) },
          ],
        },
        data,
        holder,
      );
    } else {
      this.chart.setData(data);
    }
  }

  resize() {
    if (this.chart) this.chart.setSize({ width: Math.max($("rate-chart").clientWidth, 300), height: 240 });
  }

  async resetPrefixCache() {
    const out = $("admin-result");
    for (let attempt = 0; attempt < 2; attempt++) {
      try {
        const result = await call("reset_prefix_cache", { method: "POST", kind: "admin" });
        out.textContent = `prefix cache reset: ${result.num_blocks} cached blocks dropped`;
        return;
      } catch (error) {
        out.textContent = `reset refused: ${error.message}`;
        if ((error.status !== 401 && error.status !== 403) || attempt === 1) return;
        const asked = await this.askForKey("admin", `Resetting the prefix cache needs the admin key (${error.message})`);
        if (!asked) return;
      }
    }
  }
}

// `rows`: [id, cells] each, the first one the header.
function fillTable(table, rows) {
  table.replaceChildren(
    ...rows.map(([id, cells], i) => {
      const tr = document.createElement("tr");
      if (id) tr.dataset.row = id;
      for (const cell of cells) {
        const td = document.createElement(i === 0 ? "th" : "td");
        td.textContent = cell;
        tr.append(td);
      }
      return tr;
    }),
  );
}
