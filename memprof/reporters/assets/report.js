// memprof's HTML report: draws the data embedded in the page (no network, no libraries).
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("memprof-data").textContent);
  const COLORS = DATA.category_colors;  // memprof.reporters.html.CATEGORY_COLORS
  const CATS = DATA.category_names;  // memprof's categories, in the order the items' indices use
  const $ = (id) => document.getElementById(id);
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  function fmt(n) {  // decimal units, as memprof's text reports print them
    const sign = n < 0 ? "-" : "";
    let v = Math.abs(n);
    for (const u of ["B", "kB", "MB", "GB", "TB"]) {
      if (v < 1000 || u === "TB") return u === "B" ? `${sign}${v.toFixed(0)} B` : `${sign}${v.toFixed(1)} ${u}`;
      v /= 1000;
    }
    return String(n);
  }
  const exact = (n) => n.toLocaleString("en-US");

  // ------------------------------------------------------------------------------ summary
  const S = DATA.summary;
  $("cmd").textContent = S.command || "(capture)";
  const figs = $("figures");
  for (const d of S.devices) {
    const f = el("div", {class: "figure"});
    const v = el("div", {class: "v", id: `peak-${d.device}`, "data-bytes": String(d.peak_bytes)},
      (S.exact ? "" : "≥ ") + fmt(d.peak_bytes));
    f.append(v, el("div", {class: "k"}, `${d.device} peak · ${exact(d.peak_bytes)} B at ${d.peak_t_s.toFixed(3)} s`));
    figs.append(f);
    if (d.reserved_peak_bytes !== null) {
      const r = el("div", {class: "figure"});
      r.append(el("div", {class: "v"}, fmt(d.reserved_peak_bytes)), el("div", {class: "k"}, `${d.device} reserved peak`));
      figs.append(r);
    }
  }
  const f = el("div", {class: "figure"});
  f.append(el("div", {class: "v"}, exact(S.events)), el("div", {class: "k"}, `events over ${S.duration_s.toFixed(2)} s`));
  figs.append(f);
  for (const c of S.caveats || []) $("caveats").append(el("div", {class: "caveat"}, c));
  if (!S.exact) $("caveats").append(el("div", {class: "caveat"}, "events were dropped: peaks are lower bounds"));

  // ------------------------------------------------------------------------------ one device
  let dev = null;  // the device shown
  let view = null;  // [t0, t1] visible
  let selected = -1;  // index into dev.points
  let xKey = "pos";  // x axis: allocation events (timeline positions, as memory_viz draws) or "t" (seconds)
  const x0 = (o) => (xKey === "t" ? o.t0 : o.p0), x1 = (o) => (xKey === "t" ? o.t1 : o.p1);
  const canvas = $("timeline");
  const ctx = canvas.getContext("2d");
  const M = {l: 64, r: 12, t: 10, b: 40};

  function show(d) {
    dev = d;
    const t = d.points[xKey];
    view = [t.length ? t[0] : 0, t.length ? t[t.length - 1] : 1];
    if (view[1] <= view[0]) view[1] = view[0] + 1e-6;
    const peakIdx = d.points.pos.indexOf(d.peak_pos);
    selected = peakIdx;
    legend();
    draw();
    table();
    layers();
    for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("on", b.dataset.device === d.device);
  }

  function legend() {
    const lg = $("legend");
    lg.textContent = "";
    for (const c of dev.categories) {
      const s = el("span");
      const i = el("i");
      i.style.background = COLORS[c] || "#999";
      s.append(i, document.createTextNode(c));
      lg.append(s);
    }
  }

  function size() {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return [w, h];
  }

  function draw() {
    const [w, h] = size();
    ctx.clearRect(0, 0, w, h);
    const P = dev.points, n = P.t.length;
    const pw = w - M.l - M.r, ph = h - M.t - M.b;
    let ymax = 1;
    const XS = P[xKey];
    for (let i = 0; i < n; i++) if (XS[i] >= view[0] && XS[i] <= view[1]) ymax = Math.max(ymax, P.total[i]);
    ymax *= 1.06;
    const X = (t) => M.l + ((t - view[0]) / (view[1] - view[0])) * pw;
    const Y = (v) => M.t + ph - (v / ymax) * ph;
    ctx.save();
    ctx.beginPath();
    ctx.rect(M.l, M.t, pw, ph);
    ctx.clip();
    // step bands (compiled-graph phases: a strip along the bottom, drawn over the areas)
    dev.steps.forEach((s, k) => {
      if (k % 2) { ctx.fillStyle = "rgba(29,35,48,0.05)"; ctx.fillRect(X(x0(s)), M.t, X(x1(s)) - X(x0(s)), ph); }
    });
    // stacked areas (the baseline first: blocks from before the capture are 'unattributed')
    const cum = new Float64Array(n);
    for (let c = 0; c < dev.categories.length; c++) {
      const vals = P.by_category[c];
      ctx.beginPath();
      for (let i = 0; i < n; i++) { const x = X(XS[i]); i ? ctx.lineTo(x, Y(cum[i] + vals[i])) : ctx.moveTo(x, Y(cum[i] + vals[i])); }
      for (let i = n - 1; i >= 0; i--) ctx.lineTo(X(XS[i]), Y(cum[i]));
      ctx.closePath();
      ctx.fillStyle = COLORS[dev.categories[c]] || "#999";
      ctx.fill();
      for (let i = 0; i < n; i++) cum[i] += vals[i];
    }
    ctx.beginPath();
    for (let i = 0; i < n; i++) { const x = X(XS[i]), y = Y(P.total[i]); i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); }
    ctx.strokeStyle = "#1d2330";
    ctx.lineWidth = 1;
    ctx.stroke();
    ctx.fillStyle = "#fff";
    ctx.fillRect(M.l, M.t + ph - 7, pw, 7);
    for (const c of dev.calls) {
      ctx.fillStyle = c.role === "backward" ? "#f28e2b" : "#4e79a7";
      ctx.fillRect(X(x0(c)), M.t + ph - 6, Math.max(1, X(x1(c)) - X(x0(c))), 6);
    }
    // the peak, OOMs and the selected point
    const px = X(xKey === "t" ? dev.peak_t : dev.peak_pos);
    ctx.strokeStyle = "#c2185b"; ctx.setLineDash([4, 3]);
    ctx.beginPath(); ctx.moveTo(px, M.t); ctx.lineTo(px, M.t + ph); ctx.stroke(); ctx.setLineDash([]);
    ctx.fillStyle = "#c2185b"; ctx.font = "11px system-ui";
    ctx.fillText(`peak ${fmt(dev.peak)}`, Math.min(px + 4, M.l + pw - 90), M.t + 12);
    for (const o of dev.ooms) { ctx.fillStyle = "#b00020"; ctx.fillRect(X(xKey === "t" ? o.t : o.pos) - 1, M.t, 2, ph); }
    if (selected >= 0) {
      const sx = X(XS[selected]);
      ctx.strokeStyle = "#111"; ctx.beginPath(); ctx.moveTo(sx, M.t); ctx.lineTo(sx, M.t + ph); ctx.stroke();
      ctx.fillStyle = "#111"; ctx.beginPath(); ctx.arc(sx, Y(P.total[selected]), 3.5, 0, 7); ctx.fill();
    }
    ctx.restore();
    // axes
    ctx.fillStyle = "#5b6475"; ctx.strokeStyle = "#d9dde5"; ctx.font = "11px system-ui";
    for (let k = 0; k <= 4; k++) {
      const v = (ymax / 1.06) * k / 4, y = Y(v);
      ctx.beginPath(); ctx.moveTo(M.l, y); ctx.lineTo(M.l + pw, y); ctx.stroke();
      ctx.fillText(fmt(v), 4, y + 4);
    }
    for (let k = 0; k <= 6; k++) {
      const t = view[0] + (view[1] - view[0]) * k / 6;
      const label = xKey === "t" ? `${t.toFixed(view[1] - view[0] < 0.1 ? 4 : 2)} s` : `${Math.round(t).toLocaleString("en-US")}`;
      ctx.fillText(label, Math.min(X(t) - 14, M.l + pw - 60), M.t + ph + 16);
    }
    ctx.fillText((xKey === "t" ? "seconds" : "allocation events (as memory_viz counts them)") +
      "; steps shaded in turn; strip: forward (blue) and backward (orange) compiled graphs", M.l, h - 6);
  }

  function nearest(clientX) {
    const r = canvas.getBoundingClientRect();
    const t = view[0] + ((clientX - r.left - M.l) / (r.width - M.l - M.r)) * (view[1] - view[0]);
    const T = dev.points[xKey];
    let lo = 0, hi = T.length - 1;
    while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (T[mid] < t) lo = mid; else hi = mid; }
    return Math.abs(T[lo] - t) <= Math.abs(T[hi] - t) ? lo : hi;
  }

  // ------------------------------------------------------------------------------ tables
  let sortKey = "bytes", sortAsc = false;
  function liveRows(i) {
    const pos = dev.points.pos[i], I = dev.items, S = dev.strings, t = dev.points.t[i];
    const rows = [];
    for (let k = 0; k < I.alloc.length; k++) {
      if (I.alloc[k] <= pos && pos < I.free[k]) {
        rows.push({node: S[I.node[k]], layer: S[I.layer[k]], kernel: S[I.kernel[k]], category: CATS[I.category[k]],
          bytes: I.bytes[k], age: t - I.t[k]});
      }
    }
    return rows;
  }

  function table() {
    const i = selected;
    const body = $("live-body");
    body.textContent = "";
    if (i < 0) return;
    const total = dev.points.total[i];
    const rows = liveRows(i);
    const listed = rows.reduce((a, r) => a + r.bytes, 0);
    rows.sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      const c = typeof x === "number" ? x - y : String(x).localeCompare(String(y));
      return sortAsc ? c : -c;
    });
    const at = dev.points.pos[i] === dev.peak_pos ? "the peak" : `${dev.points.t[i].toFixed(4)} s`;
    $("at-label").textContent = `${dev.device} at ${at}: ${fmt(total)} (${exact(total)} B) live`;
    $("at-label").dataset.bytes = String(total);
    $("at-label").dataset.pos = String(dev.points.pos[i]);
    $("at-label").dataset.device = dev.device;
    const shown = rows.slice(0, 300);
    let sum = 0;
    for (const r of shown) {
      sum += r.bytes;
      const tr = el("tr");
      tr.append(el("td", {class: "mono", title: r.node}, r.node), el("td", {class: "mono"}, r.layer),
        el("td", {class: "mono", title: r.kernel}, r.kernel), el("td", {}, r.category),
        el("td", {class: "num"}, exact(r.bytes)), el("td", {class: "num"}, r.age >= 1 ? `${r.age.toFixed(2)} s` : `${(r.age * 1e3).toFixed(1)} ms`));
      body.append(tr);
    }
    const rest = total - sum;  // every live allocation not shown, and blocks from before the capture
    if (rest) {
      const tr = el("tr", {class: "rest"});
      const what = rows.length > 300 ? `${rows.length - 300} more allocations, smaller ones and blocks from before the capture`
        : "smaller allocations and blocks from before the capture";
      tr.append(el("td", {colspan: "4"}, `(${what})`), el("td", {class: "num"}, exact(rest)), el("td"));
      body.append(tr);
    }
    $("live-total").textContent = exact(total);
    $("live-total").dataset.bytes = String(sum + rest);  // the rows as shown: they sum to the point's bytes
    $("live-count").textContent = `${shown.length} of ${rows.length} allocations shown (${fmt(listed)})`;
  }

  function layers() {
    const lc = dev.layer_category;
    const cats = CATS.filter((c) => Object.values(lc).some((r) => r[c]));
    const head = $("lc-head"), body = $("lc-body");
    head.textContent = ""; body.textContent = "";
    const hr = el("tr");
    hr.append(el("th", {}, "layer"));
    for (const c of cats) hr.append(el("th", {class: "num"}, c));
    hr.append(el("th", {class: "num"}, "total"));
    head.append(hr);
    const entries = Object.entries(lc).map(([k, r]) => [k, r, Object.values(r).reduce((a, b) => a + b, 0)]);
    entries.sort((a, b) => b[2] - a[2]);
    for (const [k, r, tot] of entries) {
      const tr = el("tr");
      tr.append(el("td", {class: "mono"}, k));
      for (const c of cats) tr.append(el("td", {class: "num"}, r[c] ? fmt(r[c]) : ""));
      tr.append(el("td", {class: "num"}, fmt(tot)));
      body.append(tr);
    }
  }

  for (const th of document.querySelectorAll("#live thead th")) {
    th.addEventListener("click", () => {
      const k = th.dataset.key;
      if (sortKey === k) sortAsc = !sortAsc; else { sortKey = k; sortAsc = k !== "bytes" && k !== "age"; }
      for (const o of document.querySelectorAll("#live thead th")) o.classList.remove("sorted", "asc");
      th.classList.add("sorted");
      if (sortAsc) th.classList.add("asc");
      table();
    });
  }

  // ------------------------------------------------------------------------------ interaction
  const tip = $("tip");
  let drag = null;
  canvas.addEventListener("mousemove", (e) => {
    if (drag) {
      const r = canvas.getBoundingClientRect();
      const dt = ((e.clientX - drag.x) / (r.width - M.l - M.r)) * (drag.v[1] - drag.v[0]);
      view = [drag.v[0] - dt, drag.v[1] - dt];
      drag.moved = true;
      draw();
      return;
    }
    const i = nearest(e.clientX);
    const P = dev.points;
    tip.style.display = "block";
    const r = canvas.getBoundingClientRect();
    tip.style.left = `${Math.min(e.clientX - r.left + 12, r.width - 180)}px`;
    tip.style.top = `${e.clientY - r.top + 12}px`;
    tip.textContent = `event ${P.pos[i].toLocaleString("en-US")} · ${P.t[i].toFixed(4)} s · ${fmt(P.total[i])}`;
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; drag = null; });
  canvas.addEventListener("mousedown", (e) => { drag = {x: e.clientX, v: view.slice(), moved: false}; });
  canvas.addEventListener("mouseup", (e) => {
    const moved = drag && drag.moved;
    drag = null;
    if (!moved) { selected = nearest(e.clientX); draw(); table(); }
  });
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    const r = canvas.getBoundingClientRect();
    const f = Math.min(1, Math.max(0, (e.clientX - r.left - M.l) / (r.width - M.l - M.r)));
    const t = view[0] + f * (view[1] - view[0]);
    const s = e.deltaY > 0 ? 1.25 : 0.8;
    view = [t - (t - view[0]) * s, t + (view[1] - t) * s];
    draw();
  }, {passive: false});
  canvas.addEventListener("dblclick", () => { show(dev); });
  window.addEventListener("resize", () => draw());
  for (const r of document.querySelectorAll("input[name=xaxis]")) {
    r.addEventListener("change", () => { xKey = r.value; const keep = selected; show(dev); selected = keep; draw(); table(); });
  }
  $("to-peak").addEventListener("click", () => { selected = dev.points.pos.indexOf(dev.peak_pos); draw(); table(); });

  // ------------------------------------------------------------------------------ ranks side by side
  function lanes() {
    // a distributed run: every rank's devices on one time axis and one byte scale, each its peak marked
    const box = $("lanes");
    const all = DATA.devices;
    $("lanes-section").hidden = false;
    $("lanes-hint").textContent = (DATA.lanes.aligned ? "seconds since the first rank's capture began (one host's clock)"
      : `each rank's seconds since its own capture began (${DATA.lanes.why_not})`) +
      "; one byte scale for all; click a lane to show it above";
    const tOf = (d, i) => d.points.t[i] + (d.offset_s || 0);
    let lo = Infinity, hi = -Infinity, ymax = 1;
    for (const d of all) {
      const n = d.points.t.length;
      if (n) { lo = Math.min(lo, tOf(d, 0)); hi = Math.max(hi, tOf(d, n - 1)); }
      ymax = Math.max(ymax, d.peak);
    }
    if (!(hi > lo)) { lo = 0; hi = 1; }
    ymax *= 1.08;
    for (const d of all) {
      const row = el("div", {class: "lane", "data-device": d.device, "data-peak": String(d.peak)});
      row.append(el("div", {class: "lane-label"}, `${d.device} · peak ${fmt(d.peak)} at ${(d.peak_t + (d.offset_s || 0)).toFixed(3)} s`));
      const c = el("canvas");
      row.append(c);
      box.append(row);
      const dpr = window.devicePixelRatio || 1, w = c.clientWidth, h = c.clientHeight;
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
      const g = c.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      const X = (t) => 4 + ((t - lo) / (hi - lo)) * (w - 8), Y = (v) => h - 2 - (v / ymax) * (h - 4);
      const P = d.points, n = P.t.length, cum = new Float64Array(n);
      for (let k = 0; k < d.categories.length; k++) {
        const vals = P.by_category[k];
        g.beginPath();
        for (let i = 0; i < n; i++) { const x = X(tOf(d, i)); i ? g.lineTo(x, Y(cum[i] + vals[i])) : g.moveTo(x, Y(cum[i] + vals[i])); }
        for (let i = n - 1; i >= 0; i--) g.lineTo(X(tOf(d, i)), Y(cum[i]));
        g.closePath();
        g.fillStyle = COLORS[d.categories[k]] || "#999";
        g.fill();
        for (let i = 0; i < n; i++) cum[i] += vals[i];
      }
      const px = X(d.peak_t + (d.offset_s || 0));
      g.strokeStyle = "#c2185b"; g.setLineDash([3, 2]);
      g.beginPath(); g.moveTo(px, 0); g.lineTo(px, h); g.stroke(); g.setLineDash([]);
      row.addEventListener("click", () => { show(d); $("timeline").scrollIntoView({block: "center"}); });
    }
  }

  // ------------------------------------------------------------------------------ plans, steps
  function simpleTable(head, rows, foot) {  // head: [label, numeric?]; rows and foot: cell texts
    const t = el("table"), th = el("thead"), hr = el("tr"), tb = el("tbody");
    head.forEach(([h, num]) => hr.append(el("th", num ? {class: "num"} : {}, h)));
    th.append(hr);
    t.append(th, tb);
    const row = (cells, cls) => {
      const tr = el("tr", cls ? {class: cls} : {});
      cells.forEach((c, k) => tr.append(el("td", head[k][1] ? {class: "num"} : {class: "mono", title: String(c)}, String(c))));
      return tr;
    };
    for (const r of rows) tb.append(row(r.cells, r.cls));
    if (foot) { const tf = el("tfoot"); tf.append(row(foot)); t.append(tf); }
    return t;
  }
  function planDetail(d) {
    // what the partitioner saved and recomputed, by layer and by value, and what memprof's pass changed
    const box = el("details", {class: "plan", id: `plan-${d.index}`, "data-saved-bytes": String(d.saved_bytes)});
    box.append(el("summary", {}, `plan ${d.index}: saved ${fmt(d.saved_bytes)}, recomputed ${fmt(d.recomputed_bytes)}` +
      (d.remat ? ` · remat ${d.remat.mode}: ${d.remat.saved_added.length} layer boundaries saved` : "")));
    const byLayer = el("div", {class: "scroll short"});
    byLayer.append(el("h3", {}, "by layer"), simpleTable(
      [["layer"], ["saved", 1], ["values", 1], ["recomputed", 1], ["nodes", 1]],
      d.by_layer.map((r) => ({cells: [r.layer, exact(r.saved_bytes), r.saved, exact(r.recomputed_bytes), r.recomputed]})),
      ["total", exact(d.saved_bytes), d.by_layer.reduce((a, r) => a + r.saved, 0), exact(d.recomputed_bytes),
        d.by_layer.reduce((a, r) => a + r.recomputed, 0)]));
    const values = el("div", {class: "scroll short"});
    const added = new Set(d.remat ? d.remat.saved_added.map((v) => v.name) : []);
    const rows = d.saved.map((v) => ({cells: [v.name + (added.has(v.name) ? " (remat)" : "") + (v.mask ? " (mask)" : ""),
      v.target, v.layer, (v.shape || []).join("×"), v.bytes === null ? "symbolic" : exact(v.bytes)]}));
    if (d.saved_rest.count) rows.push({cls: "rest", cells: [`(${d.saved_rest.count} smaller values)`, "", "", "", exact(d.saved_rest.bytes)]});
    values.append(el("h3", {}, "saved values, largest first"), simpleTable(
      [["node"], ["op"], ["layer"], ["shape"], ["bytes", 1]], rows, ["total", "", "", "", exact(d.saved_bytes)]));
    box.append(byLayer, values);
    if (d.saved_symbolic) box.append(el("div", {class: "hint"}, `${d.saved_symbolic} saved values have symbolic sizes (dynamic shapes): not in the bytes`));
    if (d.recomputed_random.length) box.append(el("div", {class: "caveat"}, `redrawn in the backward: ${d.recomputed_random.join(", ")}`));
    const r = d.remat;
    if (r) {
      const lines = [r.summary,
        r.start_budget !== null ? `started from budget ${r.start_budget}'s stock saved set` : "",
        r.stock_saved_bytes !== null && r.saved_bytes !== null ? `saved activations (graph inputs aside) ${fmt(r.stock_saved_bytes)} (stock) -> ${fmt(r.saved_bytes)}` : "",
        r.estimate_before !== null && r.estimate_after !== null ?
          `its FX-graph estimate of the pair's peak ${fmt(r.estimate_before)} -> ${fmt(r.estimate_after)}` : "",
        r.saved_added.length ? `layer boundaries saved: ${r.saved_added.map((v) => `${v.name} (${v.layer}, ${v.bytes === null ? "?" : fmt(v.bytes)})`).join(", ")}` : "",
        r.random_saved.length ? `random values saved instead of redrawn: ${r.random_saved.map((v) => v.name).join(", ")}` : "",
        r.masks_saved.length ? `attention masks saved: ${r.masks_saved.map((v) => v.name).join(", ")}` : "",
        `use-site edits: ${r.usesite_edits}${r.usesite_stopped ? ` (stopped: ${r.usesite_stopped})` : ""}`,
        `the pass took ${r.seconds.toFixed(2)} s beside the partitioner's ${r.partition_seconds.toFixed(2)} s`,
        ...r.notes];
      const rb = el("div", {class: "remat", id: `remat-${d.index}`});
      rb.append(el("h3", {}, `memprof's remat pass (${r.mode}, ${r.status})`));
      for (const line of lines.filter((x) => x)) rb.append(el("div", {}, line));
      box.append(rb);
    }
    return box;
  }
  const plans = $("plans");
  if (!S.plans.length) plans.append(el("div", {class: "hint"}, "no compiled forward/backward pairs in this capture"));
  const details = {};
  for (const d of DATA.plan_details || []) details[d.index] = d;
  for (const p of S.plans) {
    plans.append(el("div", {}, `compile plan ${p.index} (${p.backend}, budget ${p.budget}): ${p.saved} saved values ` +
      `(${fmt(p.saved_bytes)}), ${p.recomputed} recomputed nodes, ${p.random_ops} random ops` +
      (p.recomputed_random.length ? `, ${p.recomputed_random.length} recomputed in the backward (redrawn)` : "") +
      (p.remat ? ` · ${p.remat}` : "")));
    if (details[p.index]) plans.append(planDetail(details[p.index]));
  }
  for (const w of S.warnings || []) plans.append(el("div", {class: "caveat"}, w));
  if ((S.graph_breaks || []).length) {
    plans.append(el("div", {}, `graph breaks: Dynamo compiled the code in parts, split at ${S.graph_breaks.length} ` +
      `place${S.graph_breaks.length === 1 ? "" : "s"} (a tensor one part returns and the next takes stays live across ` +
      "the split, outside what the partitioner and the budget decide):"));
    for (const b of S.graph_breaks) plans.append(el("div", {class: "hint"}, b));
  }
  const tabs = $("tabs");
  for (const d of DATA.devices) {
    const b = el("button", {"data-device": d.device}, d.device);
    b.addEventListener("click", () => show(d));
    tabs.append(b);
  }
  if (DATA.devices.length) show(DATA.devices[0]);
  if (DATA.lanes) lanes();
  document.body.dataset.ready = "1";
})();
