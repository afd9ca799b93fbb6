// Rolling figures: token rates, TTFT and inter-token latency percentiles, queue sizes.

function ms(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

function percentiles(p) {
  if (!p) return "–";
  return `${ms(p.p50)} <small>p50 · p90 ${ms(p.p90)} · p99 ${ms(p.p99)}</small>`;
}

export class StatsPanel {
  constructor(list) {
    this.list = list;
  }

  update(frame) {
    const tiles = [
      ["output tok/s", `${frame.output_tok_s.toFixed(1)} <small>last 5 s</small>`, "generated tokens per second"],
      ["computed tok/s", `${frame.computed_tok_s.toFixed(1)} <small>prompt + generated</small>`, "tokens through the model per second, last 5 s"],
      ["time to first token", percentiles(frame.ttft), "recent requests"],
      ["inter-token latency", percentiles(frame.itl), "recent tokens"],
      ["running · waiting", `${frame.num_running} · ${frame.num_waiting} <small>sequences</small>`, "sequences"],
      ["steps · preemptions", `${frame.num_steps} · ${frame.num_preemptions} <small>since start</small>`, "since start"],
    ];
    const items = tiles.map(([name, value, help]) => {
      const div = document.createElement("div");
      div.title = help;
      const dt = div.appendChild(document.createElement("dt"));
      dt.textContent = name;
      const dd = div.appendChild(document.createElement("dd"));
      dd.innerHTML = value; // built above from numbers only
      return div;
    });
    this.list.replaceChildren(...items);
  }
}
