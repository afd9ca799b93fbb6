// The KV block pool as a canvas grid: one cell per block, coloured by the request holding it.

import { expandRuns, shortId } from "./colors.js";

const FREE = "#e9ecf0";
const CACHED = "#9fd8cb";
const SHARED_MARK = "#1d232b";
const MAX_HEIGHT = 420; // css px the grid may take before cells stop growing smaller

export class BlockGrid {
  /** canvas: the grid; tip: a tooltip element; onHover(requestId or null) when the pointer moves. */
  constructor(canvas, tip, colors, onHover) {
    this.canvas = canvas;
    this.tip = tip;
    this.colors = colors;
    this.onHover = onHover;
    this.owners = new Map(); // block id -> ids of the requests holding it, oldest first
    this.cached = new Set();
    this.numBlocks = 0;
    this.layout = { cell: 8, cols: 1 };
    this.highlight = null;
    canvas.addEventListener("mousemove", (event) => this.hover(event));
    canvas.addEventListener("mouseleave", () => this.leave());
    new ResizeObserver(() => this.draw()).observe(canvas.parentElement);
  }

  /** Take a frame's pool: who holds which block, and which free blocks keep a prefix. */
  update(frame) {
    this.numBlocks = frame.num_blocks;
    this.owners = new Map();
    for (const request of frame.requests) {
      for (const blockId of expandRuns(request.blocks)) {
        const holders = this.owners.get(blockId);
        if (holders) holders.push(request.id);
        else this.owners.set(blockId, [request.id]);
      }
    }
    this.cached = new Set(expandRuns(frame.cached_free));
    let shared = 0;
    for (const holders of this.owners.values()) shared += holders.length > 1 ? 1 : 0;
    // Counts of what is drawn, for tests and for anyone reading the DOM.
    const data = this.canvas.dataset;
    data.owned = String(this.owners.size);
    data.shared = String(shared);
    data.cached = String(this.cached.size);
    data.free = String(this.numBlocks - this.owners.size);
    this.draw();
    return { owned: this.owners.size, shared, cached: this.cached.size };
  }

  setHighlight(requestId) {
    if (requestId === this.highlight) return;
    this.highlight = requestId;
    this.canvas.dataset.highlight = requestId ?? "";
    this.draw();
  }

  /** Cells as large as fit: all blocks within the card's width and MAX_HEIGHT. */
  computeLayout(width) {
    const n = Math.max(this.numBlocks, 1);
    let cell = 18;
    while (cell > 2) {
      const cols = Math.max(Math.floor(width / cell), 1);
      if (Math.ceil(n / cols) * cell <= MAX_HEIGHT) break;
      cell -= 1;
    }
    const cols = Math.max(Math.floor(width / cell), 1);
    return { cell, cols, rows: Math.ceil(n / cols) };
  }

  draw() {
    const canvas = this.canvas;
    const width = canvas.parentElement.clientWidth;
    if (width === 0) return;
    const layout = (this.layout = this.computeLayout(width));
    const ratio = window.devicePixelRatio || 1;
    const height = layout.rows * layout.cell;
    canvas.style.height = `${height}px`;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const { cell, cols } = layout;
    const gap = cell >= 6 ? 1 : 0;
    const size = cell - gap;
    for (let blockId = 1; blockId <= this.numBlocks; blockId++) {
      const index = blockId - 1;
      const x = (index % cols) * cell;
      const y = Math.floor(index / cols) * cell;
      const holders = this.owners.get(blockId);
      const dim = this.highlight !== null && !(holders && holders.includes(this.highlight));
      if (holders) {
        ctx.fillStyle = this.colors.color(holders[0], dim ? 0.2 : 1);
      } else {
        ctx.fillStyle = this.cached.has(blockId) ? CACHED : FREE;
        if (dim) ctx.globalAlpha = 0.5;
      }
      ctx.fillRect(x, y, size, size);
      ctx.globalAlpha = 1;
      if (holders && holders.length > 1 && size >= 4) {
        // A shared prefix block: a dark corner, visible at any cell size.
        ctx.fillStyle = SHARED_MARK;
        ctx.beginPath();
        ctx.moveTo(x, y);
        ctx.lineTo(x + size / 2, y);
        ctx.lineTo(x, y + size / 2);
        ctx.fill();
      }
    }
  }

  blockAt(event) {
    const rect = this.canvas.getBoundingClientRect();
    const { cell, cols } = this.layout;
    const col = Math.floor((event.clientX - rect.left) / cell);
    const row = Math.floor((event.clientY - rect.top) / cell);
    if (col < 0 || col >= cols || row < 0) return null;
    const blockId = row * cols + col + 1;
    return blockId <= this.numBlocks ? blockId : null;
  }

  hover(event) {
    const blockId = this.blockAt(event);
    if (blockId === null) return this.leave();
    const holders = this.owners.get(blockId);
    let text = `block ${blockId}: `;
    if (holders) {
      text += holders.length > 1 ? `shared by ${holders.length}\n` : "held by ";
      text += holders.map(shortId).join("\n");
    } else {
      text += this.cached.has(blockId) ? "free, caches a prefix" : "free";
    }
    this.tip.textContent = text;
    this.tip.style.left = `${event.clientX + 12}px`;
    this.tip.style.top = `${event.clientY + 12}px`;
    this.tip.hidden = false;
    this.onHover(holders ? holders[0] : null);
  }

  leave() {
    this.tip.hidden = true;
    this.onHover(null);
  }
}
