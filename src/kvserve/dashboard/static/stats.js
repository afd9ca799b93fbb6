// Rolling figures: token rates, TTFT and inter-token latency percentiles, queue sizes;
// speculative decoding and the prefix cache's disk tier when the engine has them.

function ms(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

function percentiles(p) {
  if (!p) return "–";
  return `${ms(p.p50)} <small>p50 · p90 ${ms(p.p90)} · p99 ${ms(p.p99)}</small>`;
}

// A replayed trace leaves some counters out (null): shown as a dash, never as 0.
function count(value) {
  return value === null || value === undefined ? "–" : String(value);
}

function percent(share) {
  return share === null ? "–" : `${Math.round(share * 100)}%`;
}

function bytes(value) {
  if (value === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}

// [name, value, help, key] for speculative decoding; none while it is off. A replayed
// trace has no declines (nor the prefix cache's hits, below): their tiles are left out.
function specTiles(spec) {
  if (!spec) return [];
  const recent = spec.proposed_tok_s > 0 ? spec.accepted_tok_s / spec.proposed_tok_s : null;
  const tiles = [
    ["speculation accepted",
      `${percent(recent)} <small>${spec.accepted_tok_s.toFixed(1)} of ${spec.proposed_tok_s.toFixed(1)} ` +
      "proposed tok/s</small>",
      "accepted over proposed speculative tokens, last 5 s", "spec-rate"],
    ["proposed · accepted",
      `${spec.proposed} · ${spec.accepted} <small>tokens since start, ${percent(spec.acceptance)} accepted</small>`,
      "speculative tokens verified, and kept", "spec-total"],
  ];
  if (spec.declined !== null) {
    const policy = spec.adaptive ? "requests given no proposal" : "adaptive policy off";
    tiles.push(["speculation declined", `${spec.declined} <small>${policy}</small>`,
      "decoding requests whose proposals the adaptive policy expected to cost more than they gain",
      "spec-declined"]);
  }
  return tiles;
}

// The prefix cache's hits and its disk tier's work; none without a disk tier.
function diskTiles(disk) {
  if (!disk) return [];
  const state = disk.enabled ? "" : " · off after an I/O error";
  const tiles = [
    ["disk tier",
      `${disk.loads} · ${disk.writes} <small>blocks loaded · written, ${count(disk.evictions)} ` +
      `evicted · ${bytes(disk.num_bytes)} on disk${state}</small>`,
      `since start; ${bytes(disk.bytes_read)} read, ${bytes(disk.bytes_written)} written`, "disk-tier"],
  ];
  if (disk.pool_hit_tokens !== null) {
    tiles.unshift(["prefix cache hits",
      `${disk.pool_hit_tokens} <small>of ${disk.query_tokens} tokens looked up · ` +
      `${disk.disk_hits} blocks found on disk</small>`,
      "prompt tokens found at admission, blocks read back from disk included", "cache-hits"]);
  }
  return tiles;
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
      ...specTiles(frame.spec),
      ...diskTiles(frame.disk),
    ];
    const items = tiles.map(([name, value, help, key]) => {
      const div = document.createElement("div");
      div.title = help;
      if (key) div.dataset.tile = key;
      const dt = div.appendChild(document.createElement("dt"));
      dt.textContent = name;
      const dd = div.appendChild(document.createElement("dd"));
      dd.innerHTML = value; // built above from numbers and fixed words only
      return div;
    });
    this.list.replaceChildren(...items);
  }
}
