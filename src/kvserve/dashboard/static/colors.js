// A colour per request: hues a golden angle apart in order of first sight, so requests
// seen one after another never look alike. Ids not in the latest frame are forgotten.

const GOLDEN_ANGLE = 137.508;

export class RequestColors {
  constructor() {
    this.indexOf = new Map();
    this.next = 0;
  }

  /** Keep the colours of the ids in `ids`; give new ids the next hues. */
  update(ids) {
    const keep = new Set(ids);
    for (const id of this.indexOf.keys()) {
      if (!keep.has(id)) this.indexOf.delete(id);
    }
    for (const id of ids) {
      if (!this.indexOf.has(id)) this.indexOf.set(id, this.next++);
    }
  }

  color(id, alpha = 1) {
    const index = this.indexOf.get(id) ?? 0;
    const hue = (index * GOLDEN_ANGLE + 12) % 360;
    return `hsla(${hue.toFixed(1)}, 68%, ${index % 2 ? 50 : 58}%, ${alpha})`;
  }
}

/** Expand runs [first, count, first, count, ...] into block ids. */
export function expandRuns(runs) {
  const ids = [];
  for (let i = 0; i + 1 < runs.length; i += 2) {
    for (let k = 0; k < runs[i + 1]; k++) ids.push(runs[i] + k);
  }
  return ids;
}

/** A short, readable form of a request id: its tail, and the sequence index of n > 1. */
export function shortId(id) {
  const [base, seq] = id.split("#");
  const tail = base.length > 10 ? "…" + base.slice(-8) : base;
  return seq === undefined ? tail : `${tail}#${seq}`;
}
