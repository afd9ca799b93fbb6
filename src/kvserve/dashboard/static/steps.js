// The last steps as stacked bars (decode tokens under prefill-chunk tokens), the token
// budget as a dashed line, preemptions as red marks. SVG, so bars are countable DOM nodes.

const NS = "http://www.w3.org/2000/svg";
const SLOTS = 64; // bar positions: a frame carries at most this many steps
const PAD = { left: 40, right: 8, top: 14, bottom: 18 };

function el(name, attributes, parent) {
  const node = document.createElementNS(NS, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  parent.appendChild(node);
  return node;
}

export class StepChart {
  constructor(svg) {
    this.svg = svg;
  }

  /** Draw `steps` (oldest first) against `budget` and the prefill cap (or null). */
  update(steps, budget, prefillCap) {
    const svg = this.svg;
    const width = svg.clientWidth || 600;
    const height = svg.clientHeight || 190;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.replaceChildren();
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;
    let top = 1;
    for (const step of steps) top = Math.max(top, step.decode + step.prefill);
    if (prefillCap !== null && prefillCap !== undefined) top = Math.max(top, prefillCap);
    top *= 1.2;
    // The budget is drawn to scale when that leaves the bars readable; otherwise it is
    // named at the top edge, off the scale.
    const budgetOnScale = budget <= top * 2.5;
    if (budgetOnScale) top = Math.max(top, budget * 1.08);
    const y = (tokens) => PAD.top + plotH * (1 - tokens / top);
    el("line", { class: "axis", x1: PAD.left, x2: PAD.left + plotW, y1: y(0), y2: y(0) }, svg);
    for (const tick of [0, Math.round(top / 2), Math.round(top)]) {
      el("text", { x: PAD.left - 4, y: y(tick) + 3, "text-anchor": "end" }, svg).textContent = tick;
    }
    const slot = plotW / SLOTS;
    const barW = Math.max(slot - 2, 1);
    steps.forEach((step, i) => {
      const x = PAD.left + (SLOTS - steps.length + i) * slot + 1;
      const title = `step ${step.step}: ${step.decode} decode + ${step.prefill} prefill tokens` +
        (step.preempted ? `, ${step.preempted} preempted` : "");
      if (step.decode > 0) {
        const r = el("rect", { class: "decode", x, width: barW, y: y(step.decode), height: y(0) - y(step.decode) }, svg);
        el("title", {}, r).textContent = title;
      }
      if (step.prefill > 0) {
        const total = step.decode + step.prefill;
        const r = el("rect", { class: "prefill", x, width: barW, y: y(total), height: y(step.decode) - y(total) }, svg);
        el("title", {}, r).textContent = title;
      }
      if (step.preempted > 0) {
        const cx = x + barW / 2;
        const p = el("path", { class: "preempt", d: `M${cx - 5},${PAD.top - 12} h10 l-5,8 z` }, svg);
        el("title", {}, p).textContent = title;
      }
    });
    if (budgetOnScale) {
      el("line", { class: "budget", x1: PAD.left, x2: PAD.left + plotW, y1: y(budget), y2: y(budget) }, svg);
      el("text", { x: PAD.left + plotW - 2, y: y(budget) - 3, "text-anchor": "end" }, svg).textContent = `budget ${budget}`;
    } else {
      el("text", { x: PAD.left + plotW - 2, y: PAD.top - 3, "text-anchor": "end" }, svg).textContent = `budget ${budget} ↑ (off scale)`;
    }
    if (prefillCap !== null && prefillCap !== undefined && prefillCap < budget) {
      el("line", { class: "cap", x1: PAD.left, x2: PAD.left + plotW, y1: y(prefillCap), y2: y(prefillCap) }, svg);
      el("text", { x: PAD.left + 2, y: y(prefillCap) - 3 }, svg).textContent = `prefill cap while decoding ${prefillCap}`;
    }
    svg.dataset.steps = String(steps.length);
  }
}
