// Live mode: frames from the server's state stream, and the "send load" button.

export function startLive({ authHeaders, key, onFrame, setStatus }) {
  const button = document.getElementById("send-load");
  const loadStatus = document.getElementById("load-status");
  document.getElementById("live-controls").hidden = false;

  // EventSource cannot send headers: the key goes in the query (see docs/server.md).
  const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
  const source = new EventSource(`/dashboard/events${query}`);
  source.onopen = () => setStatus("live", "live");
  source.onerror = () => setStatus("connecting", "reconnecting…");
  source.onmessage = (event) => {
    const frame = JSON.parse(event.data);
    showLoad(frame.load);
    onFrame(frame);
  };

  function showLoad(load) {
    if (!load) return;
    button.disabled = load.running;
    if (load.running || load.done > 0) {
      const failed = load.failed ? `, ${load.failed} failed` : "";
      loadStatus.textContent = load.running
        ? `load: ${load.done} of ${load.total} requests done${failed}`
        : `last load: ${load.done} requests${failed}`;
    }
  }

  button.addEventListener("click", async () => {
    button.disabled = true;
    const response = await fetch("/dashboard/load", {
      method: "POST",
      headers: { ...authHeaders, "Content-Type": "application/json" },
      body: "{}",
    });
    const body = await response.json();
    if (response.ok) showLoad(body.load);
    else loadStatus.textContent = body.error ? body.error.message : `HTTP ${response.status}`;
  });
  window.addEventListener("pagehide", () => source.close());
}
