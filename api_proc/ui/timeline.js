// The timeline of the last 100 requests: one row each, oldest on top, time running to "now" on the
// right. Times come relative to the server's now (negative seconds), so no clocks are compared.
//   tokenize: arrival in the tokenizer process -> handed to the engine
//   queue:    -> first scheduled by the engine (until the first token, if that is not known yet)
//   prefill:  -> first token
//   decode:   -> end (or now, while it runs)

const COLORS = { tokenize: "#b8c2cc", queue: "#e3b341", prefill: "#d9822b", decode: "#2b6cd9", aborted: "#c62828" };
const AXIS_HEIGHT = 18;
const MIN_SPAN = 10; // seconds shown at least

export class Timeline {
  constructor(canvas, info) {
    this.canvas = canvas;
    this.info = info;
    this.entries = [];
    this.span = MIN_SPAN;
    canvas.addEventListener("mousemove", (event) => this.hover(event));
    canvas.addEventListener("mouseleave", () => {
      info.textContent = "\u00a0";
    });
  }

  rowHeight() {
    return (this.canvas.clientHeight - AXIS_HEIGHT) / Math.max(this.entries.length, 20);
  }

  draw(entries) {
    this.entries = entries;
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const oldest = entries.reduce((min, e) => Math.min(min, e.arrival), 0);
    this.span = Math.max(MIN_SPAN, -oldest * 1.02);
    const x = (t) => width * (1 + t / this.span);
    const row = this.rowHeight();
    entries.forEach((e, i) => {
      const y = i * row;
      const end = e.end === null ? 0 : e.end;
      const bar = (from, to, color) => {
        if (from === null || to === null || to < from) return;
        g.fillStyle = color;
        g.fillRect(x(from), y + 0.5, Math.max(x(to) - x(from), 1), Math.max(row - 1, 1));
      };
      bar(e.arrival, e.admitted, COLORS.tokenize);
      const queueEnd = e.scheduled !== null ? e.scheduled : e.first_token !== null ? e.first_token : end;
      bar(e.admitted, queueEnd, COLORS.queue);
      if (e.scheduled !== null) bar(e.scheduled, e.first_token, COLORS.prefill);
      if (e.first_token !== null) bar(e.first_token, end, COLORS.decode);
      if (e.finish_reason === "abort") bar(end - this.span / 300, end, COLORS.aborted);
    });
    // the time axis: a tick every "nice" number of seconds
    g.fillStyle = "#667";
    g.font = "11px system-ui, sans-serif";
    const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600].find((s) => this.span / s <= 8) || 1200;
    for (let t = 0; t > -this.span; t -= step) {
      const px = x(t);
      g.fillRect(px - 0.5, height - AXIS_HEIGHT, 1, 4);
      g.textAlign = t === 0 ? "right" : "center";
      g.fillText(t === 0 ? "now" : `${t} s`, px, height - 4);
    }
  }

  hover(event) {
    const rect = this.canvas.getBoundingClientRect();
    const e = this.entries[Math.floor((event.clientY - rect.top) / this.rowHeight())];
    if (!e) {
      this.info.textContent = "\u00a0";
      return;
    }
    const d = (from, to) => (from === null || to === null ? "–" : `${((to - from) * 1000).toFixed(0)} ms`);
    const end = e.end === null ? 0 : e.end;
    this.info.textContent =
      `engine ${e.engine} · ${e.prompt_tokens} prompt + ${e.output_tokens} output tokens · ` +
      `tokenize ${d(e.arrival, e.admitted)} · queue ${d(e.admitted, e.scheduled)} · ` +
      `prefill ${d(e.scheduled, e.first_token)} · decode ${d(e.first_token, e.first_token === null ? null : end)} · ` +
      (e.finish_reason ? `finished: ${e.finish_reason}` : "running");
  }
}
