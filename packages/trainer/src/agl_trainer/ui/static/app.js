// AGL dashboard: charts (uPlot) and polling for live updates. No build step, no network beyond this server.
"use strict";
const agl = (() => {
  const COLOURS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2"];

  function drawCharts(el, charts) {
    el.innerHTML = "";
    for (const c of charts) {
      if (!c.series.some(s => s.values.some(v => v !== null))) continue;  // a run that never logged these
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.title = c.title;
      box.innerHTML = "<h3></h3>";
      box.querySelector("h3").textContent = c.title;
      el.appendChild(box);
      const opts = {
        width: 420, height: 200,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, {}],
        series: [{ label: "step" }, ...c.series.map((s, i) => ({ label: s.label, stroke: COLOURS[i % COLOURS.length],
                                                                     width: 2, points: { size: 5 } }))],
      };
      new uPlot(opts, [c.x, ...c.series.map(s => s.values)], box);
    }
  }

  function fillSteps(tbody, table, runUrl) {
    tbody.innerHTML = "";
    for (const cells of table) {
      const tr = document.createElement("tr");
      tr.dataset.step = cells[0];
      cells.forEach((c, i) => {
        const td = document.createElement("td");
        td.className = "num";
        if (i === 0) {
          const a = document.createElement("a");
          a.href = runUrl + "/steps/" + encodeURIComponent(c);
          a.textContent = c;
          td.appendChild(a);
        } else td.textContent = c;
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    }
  }

  const fmt = v => (v === null || v === undefined) ? "-" : Number(v).toFixed(3);

  function setRunStatus(status) {
    const el = document.getElementById("run-status");
    el.textContent = status;
    el.className = "status " + status;
  }

  function showRun(d, runUrl) {
    setRunStatus(d.status);
    document.getElementById("before").textContent = fmt(d.before);
    document.getElementById("after").textContent = fmt(d.after);
    document.getElementById("n-steps").textContent = d.steps;
    const hidden = document.getElementById("steps-hidden");
    hidden.hidden = !d.table_hidden;
    document.getElementById("n-hidden").textContent = Number(d.table_hidden).toLocaleString("en-US");
    document.getElementById("points-note").hidden = d.points_every <= 1;
    document.getElementById("points-every").textContent = d.points_every;
    fillSteps(document.querySelector("#steps tbody"), d.table, runUrl);
    drawCharts(document.getElementById("charts"), d.charts);
  }

  // Calls poll() one at a time: the next call starts pollMs after the previous one ended (answered, failed or
  // threw), never before, so a slow server never has requests piling up; poll() returning false stops it.
  function every(pollMs, poll) {
    async function next() {
      let again = true;
      try { again = (await poll()) !== false; } catch (e) { /* the server is restarting: try again later */ }
      if (again) setTimeout(next, pollMs);
    }
    setTimeout(next, pollMs);
  }

  // Polls the run's JSON while the run may still change (not once it is finished: summary.json written). Each
  // poll names the version the page shows; the server answers "unchanged" (a few bytes) until the files change.
  function runPage(data, runUrl, pollMs) {
    drawCharts(document.getElementById("charts"), data.charts);
    if (data.status === "finished") return;
    let version = data.version;
    every(pollMs, async () => {
      const resp = await fetch("/api" + runUrl + "?since=" + encodeURIComponent(version));
      if (!resp.ok) return true;
      const d = await resp.json();
      if (d.unchanged) setRunStatus(d.status);
      else { version = d.version; showRun(d, runUrl); }
      return d.status !== "finished";
    });
  }

  function pollRuns(pollMs, known) {
    // the run list is small: reload the page when a run appears or a run's step count changes
    let seen = null;
    every(pollMs, async () => {
      const resp = await fetch("/api/runs");
      if (!resp.ok) return;
      const s = JSON.stringify(await resp.json());
      if (seen !== null && s !== seen) location.reload();
      seen = s;
    });
  }

  function pollGateway(pollMs) {
    every(pollMs, async () => {
      const resp = await fetch("/api/gateway");
      if (!resp.ok) return;
      const g = await resp.json();
      document.getElementById("policy").textContent = g.policy ? `${g.policy.model} (v${g.policy.version})` : "none set";
      for (const k of ["paused", "held"]) document.getElementById(k).textContent = g[k];
      document.getElementById("in-flight").textContent = g.in_flight;
      document.getElementById("n-replicas").textContent = g.replicas.length;
      const tbody = document.querySelector("#replicas tbody");
      tbody.innerHTML = "";
      for (const r of g.replicas) {
        const tr = document.createElement("tr");
        for (const v of [r.replica_id, String(r.paused), r.in_flight, r.held, r.model || "-", "v" + r.version,
                         r.updated_at.toFixed(1)]) {
          const td = document.createElement("td");
          td.textContent = v;
          tr.appendChild(td);
        }
        tbody.appendChild(tr);
      }
      const none = document.getElementById("no-replicas");
      if (none) none.hidden = g.replicas.length > 0;
    });
  }

  function reloadWhileRunning(pollMs) {
    setTimeout(() => location.reload(), Math.max(pollMs, 3000));
  }

  return { runPage, pollRuns, pollGateway, reloadWhileRunning, drawCharts };
})();
