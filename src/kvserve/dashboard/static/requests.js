// Running and waiting requests as a table; hovering a row highlights the request's blocks.

import { expandRuns, shortId } from "./colors.js";

function cell(row, text, className) {
  const td = row.insertCell();
  if (className) td.className = className;
  if (text !== undefined) td.textContent = text;
  return td;
}

function formatAge(seconds) {
  return seconds < 10 ? `${seconds.toFixed(1)} s` : `${Math.round(seconds)} s`;
}

export class RequestTable {
  /** table: the <table>; counts: where the totals go; onHover(requestId or null). */
  constructor(table, counts, colors, onHover) {
    this.body = table.tBodies[0];
    this.counts = counts;
    this.colors = colors;
    this.onHover = onHover;
    this.highlight = null;
    this.body.addEventListener("mouseover", (event) => {
      const row = event.target.closest("tr");
      if (row && row.dataset.requestId) this.onHover(row.dataset.requestId);
    });
    this.body.addEventListener("mouseleave", () => this.onHover(null));
  }

  update(frame) {
    const rows = document.createDocumentFragment();
    for (const request of frame.requests) {
      const row = document.createElement("tr");
      row.dataset.requestId = request.id;
      row.dataset.phase = request.phase;
      const swatch = cell(row).appendChild(document.createElement("span"));
      swatch.className = "swatch";
      swatch.style.background = this.colors.color(request.id);
      cell(row, shortId(request.id), "id").title = request.id;
      const phase = cell(row).appendChild(document.createElement("span"));
      phase.className = `phase ${request.phase}`;
      phase.textContent = request.preemptions > 0 && request.phase !== "preempted"
        ? `${request.phase} (preempted ×${request.preemptions})`
        : request.phase;
      this.progress(cell(row), request);
      cell(row, String(request.prompt_tokens), "num");
      cell(row, String(request.output_tokens), "num");
      cell(row, String(expandRuns(request.blocks).length), "num");
      const age = cell(row, formatAge(request.age_s), "num");
      age.title = request.phase === "waiting" || request.phase === "preempted"
        ? "time waiting since arrival" : "time since arrival";
      rows.appendChild(row);
    }
    this.body.replaceChildren(rows);
    const unlisted = frame.num_waiting_unlisted ? ` (${frame.num_waiting_unlisted} not listed)` : "";
    this.counts.textContent = `${frame.num_running} running · ${frame.num_waiting} waiting${unlisted}`;
    this.setHighlight(this.highlight);
  }

  /** Prefill: computed / known tokens. Decode: the bar is full, the text counts tokens. */
  progress(td, request) {
    const known = request.prompt_tokens + request.output_tokens;
    const bar = td.appendChild(document.createElement("span"));
    bar.className = `bar ${request.phase}`;
    const fill = bar.appendChild(document.createElement("span"));
    const fraction = request.phase === "decoding" ? 1 : request.computed_tokens / Math.max(known, 1);
    fill.style.width = `${Math.round(100 * Math.min(fraction, 1))}%`;
    td.title = `${request.computed_tokens} of ${known} tokens computed`;
  }

  setHighlight(requestId) {
    this.highlight = requestId;
    for (const row of this.body.rows) {
      row.classList.toggle("hl", requestId !== null && row.dataset.requestId === requestId);
      row.classList.toggle("dim", requestId !== null && row.dataset.requestId !== requestId);
    }
  }
}
