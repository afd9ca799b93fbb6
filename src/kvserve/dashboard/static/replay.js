// Replay mode: frames of a recorded step trace, fetched a page at a time, with
// play / pause / step / speed / seek controls. Playback follows the trace's own
// clock, scaled by the speed.

const PAGE = 200; // frames per fetch
const MIN_DELAY_MS = 20;
const MAX_DELAY_MS = 1000;

export class ReplayPlayer {
  constructor(total, authHeaders, onFrame) {
    this.total = total;
    this.authHeaders = authHeaders;
    this.onFrame = onFrame;
    this.pages = new Map(); // page index -> Promise of its frames
    this.index = 0;
    this.playing = false;
    this.timer = null;
    this.speed = 1;
    const $ = (id) => document.getElementById(id);
    this.playButton = $("replay-play");
    this.seek = $("replay-seek");
    this.position = $("replay-position");
    $("replay-controls").hidden = false;
    this.seek.max = String(Math.max(total - 1, 0));
    $("replay-step").addEventListener("click", () => { this.pause(); this.show(this.index + 1); });
    $("replay-back").addEventListener("click", () => { this.pause(); this.show(this.index - 1); });
    this.playButton.addEventListener("click", () => (this.playing ? this.pause() : this.play()));
    $("replay-speed").addEventListener("change", (event) => { this.speed = Number(event.target.value); });
    this.seek.addEventListener("input", () => { this.pause(); this.show(Number(this.seek.value)); });
  }

  page(pageIndex) {
    if (!this.pages.has(pageIndex)) {
      const url = `/dashboard/replay/frames?start=${pageIndex * PAGE}&count=${PAGE}`;
      this.pages.set(pageIndex, fetch(url, { headers: this.authHeaders })
        .then((response) => response.json()).then((body) => body.frames));
    }
    return this.pages.get(pageIndex);
  }

  async frame(index) {
    const frames = await this.page(Math.floor(index / PAGE));
    if (index % PAGE === PAGE / 4 && index + PAGE < this.total + PAGE / 4) {
      this.page(Math.floor(index / PAGE) + 1); // fetch the next page before it is needed
    }
    return frames[index % PAGE];
  }

  async show(index) {
    if (this.total === 0) return;
    this.index = Math.min(Math.max(index, 0), this.total - 1);
    const frame = await this.frame(this.index);
    this.seek.value = String(this.index);
    this.position.textContent = `frame ${this.index + 1} of ${this.total} · t = ${frame.time.toFixed(2)} s`;
    this.position.dataset.index = String(this.index);
    this.onFrame(frame);
    return frame;
  }

  play() {
    if (this.index >= this.total - 1) this.index = -1; // from the start again
    this.playing = true;
    this.playButton.textContent = "Pause";
    this.tick();
  }

  pause() {
    this.playing = false;
    this.playButton.textContent = "Play";
    clearTimeout(this.timer);
  }

  async tick() {
    if (!this.playing) return;
    const frame = await this.show(this.index + 1);
    if (!this.playing) return;
    if (this.index >= this.total - 1) return this.pause();
    const next = await this.frame(this.index + 1);
    const gap = ((next.time - frame.time) * 1000) / this.speed;
    this.timer = setTimeout(() => this.tick(), Math.min(Math.max(gap, MIN_DELAY_MS), MAX_DELAY_MS));
  }
}
