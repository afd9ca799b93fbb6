// The dashboard page: asks the server what it shows (a live engine or a replayed trace),
// then draws every frame it gets into the block grid, the request table, the step bars
// and the rolling figures. Hovering a block or a request highlights the other.

import { RequestColors } from "./colors.js";
import { BlockGrid } from "./grid.js";
import { startLive } from "./live.js";
import { ReplayPlayer } from "./replay.js";
import { RequestTable } from "./requests.js";
import { StatsPanel } from "./stats.js";
import { StepChart } from "./steps.js";

const $ = (id) => document.getElementById(id);

// The API key, when the server needs one, rides in the fragment (#key=...), which the
// browser never sends; the page sends it as a header (and as a query parameter to the
// event stream, which cannot carry headers).
// Not URLSearchParams: it would read a "+" in the key as a space.
const key = location.hash.startsWith("#key=") ? decodeURIComponent(location.hash.slice(5)) : null;
const authHeaders = key ? { Authorization: `Bearer ${key}` } : {};

const colors = new RequestColors();
let hovered = null;
const setHover = (requestId) => {
  hovered = requestId;
  grid.setHighlight(requestId);
  table.setHighlight(requestId);
};
const grid = new BlockGrid($("grid"), $("grid-tip"), colors, setHover);
const table = new RequestTable($("requests"), $("request-counts"), colors, setHover);
const chart = new StepChart($("steps"));
const stats = new StatsPanel($("stats"));

function setStatus(state, text) {
  const status = $("status");
  status.dataset.state = state;
  status.textContent = text;
}

// Frames may come faster than the screen refreshes: draw the newest once per animation frame.
let pending = null;
function onFrame(frame) {
  if (pending === null) requestAnimationFrame(() => { render(pending); pending = null; });
  pending = frame;
}

function render(frame) {
  colors.update(frame.requests.map((request) => request.id));
  const counts = grid.update(frame);
  const free = frame.num_blocks - frame.blocks_used;
  $("pool-totals").textContent =
    `${frame.blocks_used} held (${counts.shared} shared) · ${counts.cached} cached free · ` +
    `${free} free · ${frame.num_blocks} blocks of ${frame.block_size} tokens` +
    (frame.layout === "simulated" ? " · positions simulated" : "");
  table.update(frame);
  chart.update(frame.steps, frame.budget, frame.prefill_cap);
  stats.update(frame);
  if (hovered !== null) setHover(hovered);
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

async function boot() {
  const response = await fetch("/dashboard/info", { headers: authHeaders });
  if (response.status === 401) {
    setStatus("error", "API key needed");
    $("main").hidden = true;
    const form = $("key-form");
    form.hidden = false;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      location.hash = `key=${encodeURIComponent($("key-input").value)}`;
      location.reload();
    });
    return;
  }
  const info = await response.json();
  $("model").textContent = info.model;
  if (info.mode === "replay") {
    setStatus("replay", "replay");
    $("footer").textContent = `Replaying ${info.trace}: ${info.num_frames} steps. ${info.note}`;
    const player = new ReplayPlayer(info.num_frames, authHeaders, onFrame);
    await player.show(0);
  } else {
    startLive({ authHeaders, key, onFrame, setStatus });
  }
}

boot().catch((error) => setStatus("error", String(error)));
