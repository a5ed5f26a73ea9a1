/* The dashboard pages, in plain JS (no build step).
 *
 * Both pages open one websocket that reconnects on its own (the server restarting, the network
 * going away) and get a "history" message (the chart columns ingest recorded over the chosen
 * span), then a "frame" every push interval, with the points recorded since ("chart"); choosing
 * another span asks for its history. The fleet page keeps one table row per pod and updates its
 * cells in place, so 200 pods cost a few thousand text updates a second at most; sorting and
 * filtering only reorder or hide existing rows. The gateways' tables are keyed rows too; their
 * prefill/decode disaggregation part (a table, the pods' prefill columns) shows only once a
 * gateway has served P/D. Charts are uPlot (node_modules/uplot, served by the project itself);
 * their legends show the latest values until the cursor points elsewhere.
 */
(function () {
  "use strict";

  const body = document.body;
  const PUSH_SECONDS = parseFloat(body.dataset.pushSeconds) || 1;
  const HISTORY_SECONDS = parseFloat(body.dataset.historySeconds) || 600;
  const FLEET_URL = body.dataset.fleetUrl || "/dashboard/";
  const CHART_PODS = 8;
  // Colour-blind-friendly, each at least 3:1 against white (lines, not text).
  const PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#8a6d00", "#56b4e9", "#000000", "#e69f00"];

  // ---- formatting -------------------------------------------------------------------------

  const intFormat = new Intl.NumberFormat("en-US");
  const rateFormat = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  const fineRateFormat = new Intl.NumberFormat("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  const DASH = "—";

  const fmt = {
    int: (n) => (n == null ? DASH : intFormat.format(n)),
    rate: (n) => (n == null ? DASH : rateFormat.format(n)),
    fineRate: (n) => (n == null ? DASH : fineRateFormat.format(n)),
    percent: (x) => (x == null ? DASH : (x * 100).toFixed(1) + " %"),
    age(s) {
      if (s == null) return "never";
      if (s < 1) return "just now";
      if (s < 90) return Math.round(s) + " s ago";
      if (s < 5400) return Math.round(s / 60) + " min ago";
      return (s / 3600).toFixed(1) + " h ago";
    },
    tiers(byTier) {
      const parts = Object.entries(byTier || {}).map(([tier, n]) => tier + " " + intFormat.format(n));
      return parts.length ? parts.join(" · ") : DASH;
    },
    time: (t) => new Date(t * 1000).toLocaleTimeString("en-GB"),
    seconds(s) {
      if (s == null) return DASH;
      const ms = s * 1000;
      if (ms < 10) return ms.toFixed(1) + " ms";
      if (ms < 1000) return Math.round(ms) + " ms";
      return s.toFixed(2) + " s";
    },
    // Two quantiles as "120 ms / 480 ms"; a dash when neither is known.
    quantiles: (a, b) => (a == null && b == null ? DASH : `${fmt.seconds(a)} / ${fmt.seconds(b)}`),
    // {"connect": 3, "status": 1} as "connect 3 · status 1".
    counts(byName) {
      const parts = Object.entries(byName || {}).map(([name, n]) => (name || "?") + " " + intFormat.format(n));
      return parts.length ? parts.join(" · ") : DASH;
    },
    // "n/a": this web process has no such scoring counter; a dash: no request in the interval.
    scoreRate: (totals) => (totals.scoring_available ? fmt.rate(totals.score_requests_per_s) : "n/a"),
    hitRate: (totals) => (totals.hit_rate_available ? fmt.percent(totals.hit_rate) : "n/a"),
  };

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  // ---- the live connection ----------------------------------------------------------------

  /* Returns send(message): to the server, when connected. hello() (if given) is sent on each
     connection that opens (what the page asks for beyond the defaults). */
  function connect(path, onMessage, hello) {
    const status = document.getElementById("connection");
    let delay = 500;
    let socket = null;
    let watchdog = null;

    function show(state, text) {
      status.dataset.state = state;
      setText(status, text);
    }
    // A connection that went quiet without closing (a stuck server, a dead network path) is
    // closed here so that the retry below kicks in.
    function arm() {
      clearTimeout(watchdog);
      watchdog = setTimeout(() => socket.close(), Math.max(5000, PUSH_SECONDS * 5000));
    }
    function open() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      socket = new WebSocket(scheme + location.host + path);
      socket.onopen = () => {
        delay = 500;
        show("live", "Live");
        arm();
        const message = hello && hello();
        if (message) socket.send(JSON.stringify(message));
      };
      socket.onmessage = (event) => {
        arm();
        onMessage(JSON.parse(event.data));
      };
      socket.onclose = () => {
        clearTimeout(watchdog);
        show("down", "Disconnected, retrying in " + (delay / 1000).toFixed(1) + " s");
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 5000);
      };
    }
    open();
    return (message) => {
      if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
    };
  }

  /* The span select of the charts: starts at the server's default span; onChange(seconds). */
  function spanControl(onChange) {
    const select = document.getElementById("chart-span");
    if ([...select.options].some((o) => Number(o.value) === HISTORY_SECONDS)) select.value = String(HISTORY_SECONDS);
    select.addEventListener("change", () => onChange(Number(select.value)));
    return () => Number(select.value);
  }

  /* Legend values: at the cursor, else the latest value, so that the legend reads at once. */
  function legendValue(format) {
    return (u, v, sidx, idx) => {
      if (idx == null) {
        const values = u.data[sidx];
        let i = values.length - 1;
        while (i >= 0 && values[i] == null) i--;
        v = i >= 0 ? values[i] : null;
      }
      return v == null ? DASH : format(v);
    };
  }

  // ---- charts -----------------------------------------------------------------------------

  /* A uPlot time chart that follows its container's width; rebuilt when its series change. */
  class TimeChart {
    constructor(el, { axes, scales }) {
      this.el = el;
      // Clock times only: uPlot's default adds dates that collide at this width.
      this.axes = [{ space: 70, values: (u, ticks) => ticks.map(fmt.time) }, ...axes.slice(1)];
      this.scales = scales;
      this.plot = null;
      this.labels = null;
      new ResizeObserver(() => {
        if (this.plot) this.plot.setSize(this.size());
      }).observe(el);
    }
    size() {
      return { width: Math.max(this.el.clientWidth, 300), height: 240 };
    }
    /* series: [{label, scale, values, dash?}], t: unix seconds. */
    draw(t, series) {
      // Without the charting library (node_modules not installed) the numbers still work.
      if (typeof uPlot === "undefined") return;
      const data = [t, ...series.map((s) => s.values)];
      const labels = series.map((s) => s.label).join("\n");
      if (this.plot && labels === this.labels) {
        this.plot.setData(data);
        return;
      }
      if (this.plot) this.plot.destroy();
      this.labels = labels;
      this.plot = new uPlot(
        {
          ...this.size(),
          scales: { x: { time: true }, ...this.scales },
          axes: this.axes,
          series: [
            { label: "time", value: legendValue(fmt.time) },
            ...series.map((s, i) => ({
              label: s.label,
              scale: s.scale,
              stroke: PALETTE[i % PALETTE.length],
              width: 2,
              dash: s.dash,
              value: legendValue(s.format || fmt.rate),
            })),
          ],
        },
        data,
        this.el,
      );
    }
  }

  /* Columns of a time series, trimmed to the span shown. Columns can appear at any time (a new
     pod): their past is filled with nulls. A gap in time (no point was recorded: no ingest
     process ran) gets a null row, so that lines break there instead of bridging it. */
  class Columns {
    constructor() {
      this.t = [];
      this.cols = new Map();
      this.seconds = HISTORY_SECONDS;
      this.step = 1;
    }
    get(name) {
      if (!this.cols.has(name)) this.cols.set(name, new Array(this.t.length).fill(null));
      return this.cols.get(name);
    }
    /* A history message: its span, the step between its points, and its columns. */
    reset(seconds, step, t, columns) {
      this.t = [];
      this.cols = new Map();
      this.seconds = seconds;
      this.step = step;
      this.extend(t, columns);
    }
    extend(t, columns) {
      t.forEach((at, i) => this.push(at, Object.fromEntries(Object.entries(columns).map(([n, v]) => [n, v[i]]))));
    }
    push(t, values) {
      const last = this.t[this.t.length - 1];
      if (last != null && t <= last) return; // already shown (a frame racing a new history)
      if (last != null && t - last > 3 * this.step) this.append(last + this.step, {});
      this.append(t, values);
      this.trim(t);
    }
    append(t, values) {
      for (const name of Object.keys(values)) this.get(name);
      this.t.push(t);
      for (const [name, col] of this.cols) col.push(values[name] ?? null);
    }
    trim(now) {
      let drop = 0;
      while (drop < this.t.length && this.t[drop] < now - this.seconds) drop++;
      if (!drop) return;
      this.t.splice(0, drop);
      for (const [name, col] of this.cols) {
        col.splice(0, drop);
        if (col.every((v) => v == null)) this.cols.delete(name);
      }
    }
  }

  /* A table body whose rows are keyed (a gateway; a gateway's pod) and whose cells are updated
     in place. columns: [{key, num?, className?, text(d)?, render(cell, d)?, bad(d)?}], the first a
     row heading; mark(tr, d) names a new row (data attributes). update([{key, data}]) puts the
     rows in that order and drops rows not given. */
  class KeyedRows {
    constructor(tbody, columns, mark) {
      this.tbody = tbody;
      this.columns = columns;
      this.mark = mark;
      this.rows = new Map();
      this.order = "";
    }
    makeRow(data) {
      const tr = document.createElement("tr");
      this.mark(tr, data);
      const cells = {};
      this.columns.forEach((col, i) => {
        const cell = document.createElement(i === 0 ? "th" : "td");
        if (i === 0) cell.scope = "row";
        cell.dataset.col = col.key;
        if (col.num) cell.classList.add("num");
        if (col.className) cell.classList.add(col.className);
        tr.append(cell);
        cells[col.key] = cell;
      });
      return { tr, cells };
    }
    update(items) {
      const seen = new Set();
      for (const { key, data } of items) {
        seen.add(key);
        let entry = this.rows.get(key);
        if (!entry) this.rows.set(key, (entry = this.makeRow(data)));
        for (const col of this.columns) {
          const cell = entry.cells[col.key];
          if (col.render) col.render(cell, data);
          else setText(cell, col.text(data));
          if (col.bad) cell.classList.toggle("bad", Boolean(col.bad(data)));
        }
      }
      for (const [key, entry] of this.rows) {
        if (!seen.has(key)) {
          entry.tr.remove();
          this.rows.delete(key);
        }
      }
      const order = items.map((item) => item.key).join("\n");
      if (order !== this.order) {
        this.tbody.append(...items.map((item) => this.rows.get(item.key).tr));
        this.order = order;
      }
    }
  }

  // ---- the fleet page ---------------------------------------------------------------------

  // A pod's state (registry/liveness.py pod_state), in the order a sort puts them.
  const STATUS_RANK = { active: 0, idle: 1, stale: 2, down: 3, disabled: 4 };

  const COLUMNS = [
    { key: "pod", text: (r) => r.pod },
    { key: "model", text: (r) => r.model || DASH },
    { key: "blocks", num: true, text: (r) => fmt.int(r.blocks) },
    { key: "blocks_by_tier", text: (r) => fmt.tiers(r.blocks_by_tier), sortBy: (r) => r.blocks },
    { key: "stored_per_s", num: true, text: (r) => fmt.rate(r.stored_per_s) },
    { key: "removed_per_s", num: true, text: (r) => fmt.rate(r.removed_per_s) },
    { key: "last_event_age", num: true, text: (r) => fmt.age(r.last_event_age) },
    {
      key: "seq_gaps",
      num: true,
      // Gaps are replayed; a pod whose gap could not be is cleared and resyncing until it stores.
      text: (r) => fmt.int(r.seq_gaps) + (r.replayed_batches ? ` (${fmt.int(r.replayed_batches)} replayed)` : "") +
        (r.resyncing ? " resyncing" : ""),
      bad: (r) => r.resyncing || r.lost_state_clears > 0,
    },
    { key: "decode_errors", num: true, text: (r) => fmt.int(r.decode_errors), bad: (r) => r.decode_errors > 0 },
    {
      key: "hash_alignment",
      num: true,
      text: (r) => fmt.percent(r.hash_alignment),
      bad: (r) => r.hash_alignment != null && r.hash_alignment < 1,
    },
    { key: "health", text: (r) => r.health, bad: (r) => r.health === "down" },
    { key: "status", text: (r) => r.status, sortBy: (r) => STATUS_RANK[r.status] },
  ];

  function podUrl(pod) {
    return FLEET_URL + "pods/" + encodeURIComponent(pod) + "/";
  }

  // One gateway (dashboard/gateways.py gateway_row); an unreachable one has every number null.
  const GATEWAY_COLUMNS = [
    { key: "url", text: (g) => g.url },
    {
      key: "status",
      render(cell, g) {
        if (!cell.firstChild) cell.append(document.createElement("span"), document.createElement("span"));
        const [badge, note] = cell.children;
        setText(badge, g.reachable ? "reachable" : "unreachable");
        badge.className = "status status-" + (g.reachable ? "active" : "down");
        note.className = "muted";
        setText(note, g.error || "");
      },
    },
    { key: "policy", text: (g) => g.policy || DASH },
    { key: "requests", num: true, text: (g) => fmt.int(g.requests) },
    { key: "requests_per_s", num: true, text: (g) => fmt.rate(g.requests_per_s) },
    { key: "outcomes", text: (g) => fmt.counts(g.outcomes), bad: (g) => g.outcomes && g.outcomes.upstream_error > 0 },
    {
      key: "retries",
      num: true,
      text: (g) => fmt.int(g.retries) + (g.retries ? ` (${fmt.counts(g.retries_by_reason)})` : ""),
    },
    { key: "retries_per_s", num: true, text: (g) => fmt.fineRate(g.retries_per_s), bad: (g) => g.retries_per_s > 0 },
    {
      key: "hit_rate",
      num: true,
      text: (g) => (g.reachable ? `${fmt.percent(g.hit_rate)} (${fmt.percent(g.hit_rate_overall)})` : DASH),
    },
    { key: "ttft", num: true, text: (g) => fmt.quantiles(g.ttft_p50, g.ttft_p90) },
    { key: "ttft_overall", num: true, text: (g) => fmt.quantiles(g.ttft_p50_overall, g.ttft_p90_overall) },
    {
      key: "overhead_p50",
      num: true,
      text: (g) => fmt.seconds(g.overhead_p50) + (g.reachable ? ` (${fmt.seconds(g.overhead_p50_overall)})` : ""),
    },
    {
      key: "score_failures",
      num: true,
      text: (g) => fmt.int(g.score_failures) + (g.score_failures ? ` (${fmt.counts(g.score_failures_by_reason)})` : ""),
      bad: (g) => g.score_failures > 0,
    },
  ];

  // A gateway that served prefill/decode disaggregation (its row's "pd", gateway_row's _pd).
  const PD_COLUMNS = [
    { key: "url", text: (g) => g.url },
    { key: "disaggregated", num: true, text: (g) => fmt.int(g.pd.decisions.disaggregated ?? 0) },
    { key: "disaggregated_per_s", num: true, text: (g) => fmt.rate(g.pd.decisions_per_s.disaggregated) },
    { key: "short_prompt", num: true, text: (g) => fmt.int(g.pd.decisions.short_prompt ?? 0) },
    { key: "short_prompt_per_s", num: true, text: (g) => fmt.rate(g.pd.decisions_per_s.short_prompt) },
    { key: "fallback", num: true, text: (g) => fmt.int(g.pd.decisions.fallback ?? 0) },
    {
      key: "fallback_per_s",
      num: true,
      text: (g) => fmt.fineRate(g.pd.decisions_per_s.fallback),
      bad: (g) => g.pd.decisions_per_s.fallback > 0,
    },
    { key: "fallbacks_by_reason", text: (g) => fmt.counts(g.pd.fallbacks_by_reason) },
    {
      key: "prefill_p50",
      num: true,
      text: (g) => `${fmt.seconds(g.pd.prefill_p50)} (${fmt.seconds(g.pd.prefill_p50_overall)})`,
    },
    {
      key: "transfer_p50",
      num: true,
      text: (g) => `${fmt.seconds(g.pd.transfer_p50)} (${fmt.seconds(g.pd.transfer_p50_overall)})`,
    },
  ];

  // One pod of one gateway's routing decisions (a gateway_row's "pods").
  const ROUTED_COLUMNS = [
    { key: "gateway", text: (d) => d.gateway },
    {
      key: "pod",
      render(cell, d) {
        if (!cell.firstChild) {
          const a = document.createElement("a");
          a.href = podUrl(d.pod);
          a.className = "mono";
          a.textContent = d.pod;
          cell.append(a);
        }
      },
    },
    { key: "requests", num: true, text: (d) => fmt.int(d.requests) },
    { key: "share", num: true, text: (d) => fmt.percent(d.share) },
    { key: "requests_per_s", num: true, text: (d) => fmt.rate(d.requests_per_s) },
    { key: "not_ok", num: true, text: (d) => fmt.int(d.not_ok), bad: (d) => d.not_ok > 0 },
    // A prefill pod's steps (a dash for a pod sent none), those not ok by outcome; a failure is
    // bad, a refusal is the client's request refused.
    {
      key: "prefills",
      num: true,
      className: "pd-only",
      text: (d) =>
        d.prefills == null
          ? DASH
          : fmt.int(d.prefills) +
            (Object.keys(d.prefills_not_ok).length ? ` (${fmt.counts(d.prefills_not_ok)})` : ""),
      bad: (d) => Object.keys(d.prefills_not_ok || {}).some((outcome) => outcome !== "refused"),
    },
    { key: "prefills_per_s", num: true, className: "pd-only", text: (d) => fmt.rate(d.prefills_per_s) },
  ];

  function gatewaySection() {
    const gateways = new KeyedRows(document.getElementById("gateways").tBodies[0], GATEWAY_COLUMNS, (tr, g) => {
      tr.dataset.gateway = g.url;
    });
    const routed = new KeyedRows(document.getElementById("routed").tBodies[0], ROUTED_COLUMNS, (tr, d) => {
      tr.dataset.gateway = d.gateway;
      tr.dataset.pod = d.pod;
    });
    const pd = new KeyedRows(document.getElementById("pd-gateways").tBodies[0], PD_COLUMNS, (tr, g) => {
      tr.dataset.gateway = g.url;
    });
    const gatewaysEmpty = document.getElementById("gateways-empty");
    const routedEmpty = document.getElementById("routed-empty");
    const pdPart = document.getElementById("pd-part");
    const routedTable = document.getElementById("routed");
    const routedPdNote = document.getElementById("routed-pd-note");
    const windowText = document.getElementById("gateway-window");

    return function show(rows) {
      gateways.update(rows.map((g) => ({ key: g.url, data: g })));
      const decisions = rows.flatMap((g) =>
        g.pods.map((p) => ({ key: g.url + "\n" + p.pod, data: { gateway: g.url, ...p } })),
      );
      routed.update(decisions);
      gatewaysEmpty.hidden = rows.length > 0;
      routedEmpty.hidden = decisions.length > 0;
      // The P/D part only once a gateway served P/D: no clutter for a fleet without it.
      const disaggregating = rows.filter((g) => g.pd);
      pd.update(disaggregating.map((g) => ({ key: g.url, data: g })));
      pdPart.hidden = disaggregating.length === 0;
      routedTable.classList.toggle("with-pd", disaggregating.length > 0);
      routedPdNote.hidden = disaggregating.length === 0;
      // The window grows to a minute from when this server first served a dashboard.
      const seconds = Math.max(0, ...rows.map((g) => g.window_seconds || 0));
      setText(windowText, seconds && seconds < 55 ? `last ${Math.round(seconds)} s` : "last minute");
    };
  }

  function fleetPage() {
    const table = document.getElementById("pods");
    const tbody = table.tBodies[0];
    const filter = document.getElementById("pod-filter");
    const shown = document.getElementById("pods-shown");
    const empty = document.getElementById("pods-empty");
    const indexWarning = document.getElementById("index-warning");
    const resyncWarning = document.getElementById("resync-warning");
    const resyncModels = document.getElementById("resync-models");
    const totalsEl = Object.fromEntries(
      [...document.querySelectorAll("[data-total]")].map((el) => [el.dataset.total, el]),
    );
    const rows = new Map(); // pod -> {tr, cells, data}
    let order = []; // pods in DOM order
    let sort = { key: "pod", dir: 1 };

    const blocksChart = new TimeChart(document.getElementById("chart-blocks"), {
      scales: { blocks: { auto: true, range: (u, min, max) => [0, Math.max(max, 1)] } },
      axes: [{}, { scale: "blocks", label: "blocks" }],
    });
    const trafficChart = new TimeChart(document.getElementById("chart-traffic"), {
      scales: { rate: { auto: true, range: (u, min, max) => [0, Math.max(max, 1)] }, pct: { range: [0, 100] } },
      axes: [{}, { scale: "rate", label: "per second" }, { scale: "pct", label: "hit rate %", side: 1, grid: { show: false } }],
    });
    const series = new Columns(); // fleet rates, and "pod:<id>" block counts of every pod
    const showGateways = gatewaySection();
    let scoringAvailable = false;
    let hitRateAvailable = false;
    let latestRows = [];

    // Sorting: a button in each column heading; aria-sort tells assistive technology.
    for (const th of table.tHead.rows[0].cells) {
      th.querySelector("button").addEventListener("click", () => {
        const key = th.dataset.key;
        sort = { key, dir: sort.key === key ? -sort.dir : 1 };
        for (const other of table.tHead.rows[0].cells) {
          if (other === th) other.setAttribute("aria-sort", sort.dir > 0 ? "ascending" : "descending");
          else other.removeAttribute("aria-sort");
        }
        arrange();
      });
    }
    filter.addEventListener("input", arrange);

    function makeRow(pod) {
      const tr = document.createElement("tr");
      tr.dataset.pod = pod;
      const cells = {};
      for (const col of COLUMNS) {
        const cell = document.createElement(col.key === "pod" ? "th" : "td");
        cell.dataset.col = col.key;
        if (col.key === "pod") {
          cell.scope = "row";
          const a = document.createElement("a");
          a.href = podUrl(pod);
          a.className = "mono";
          a.textContent = pod;
          cell.append(a);
        } else if (col.key === "status") {
          cell.append(document.createElement("span"));
        }
        if (col.num) cell.className = "num";
        tr.append(cell);
        cells[col.key] = cell;
      }
      return { tr, cells, data: null };
    }

    function fillRow(entry, r) {
      entry.data = r;
      for (const col of COLUMNS) {
        const cell = entry.cells[col.key];
        if (col.key === "pod") continue;
        if (col.key === "status") {
          const badge = cell.firstChild;
          setText(badge, r.status);
          badge.className = "status status-" + r.status;
          continue;
        }
        setText(cell, col.text(r));
        if (col.bad) cell.classList.toggle("bad", col.bad(r));
      }
    }

    function sortValue(col, r) {
      const v = col.sortBy ? col.sortBy(r) : r[col.key];
      return typeof v === "string" ? v.toLowerCase() : v;
    }

    function arrange() {
      const col = COLUMNS.find((c) => c.key === sort.key);
      const entries = [...rows.values()];
      entries.sort((a, b) => {
        const x = sortValue(col, a.data);
        const y = sortValue(col, b.data);
        // Unknown values (no rate yet, never seen) go last whichever way the column sorts.
        if (x == null && y != null) return 1;
        if (y == null && x != null) return -1;
        if (x !== y && x != null) return (x < y ? -1 : 1) * sort.dir;
        return a.data.pod < b.data.pod ? -1 : 1;
      });
      const wanted = entries.map((e) => e.data.pod);
      if (wanted.join("\n") !== order.join("\n")) {
        tbody.append(...entries.map((e) => e.tr));
        order = wanted;
      }
      const needle = filter.value.trim().toLowerCase();
      let visible = 0;
      for (const e of entries) {
        const d = e.data;
        const match = !needle || [d.pod, d.model, d.status].some((s) => s.toLowerCase().includes(needle));
        e.tr.hidden = !match;
        visible += match;
      }
      setText(shown, needle ? `Showing ${visible} of ${entries.length} pods` : `${entries.length} pods`);
      empty.hidden = entries.length > 0;
    }

    function showTotals(t) {
      setText(totalsEl.pods, fmt.int(t.pods));
      setText(totalsEl.statuses, `${t.active} / ${t.idle} / ${t.stale} / ${t.down} / ${t.disabled}`);
      setText(totalsEl.blocks, fmt.int(t.blocks) + (t.blocks ? ` (${fmt.tiers(t.blocks_by_tier)})` : ""));
      setText(totalsEl.stored_per_s, fmt.rate(t.stored_per_s));
      setText(totalsEl.removed_per_s, fmt.rate(t.removed_per_s));
      setText(totalsEl.events_per_s, fmt.rate(t.events_per_s));
      setText(totalsEl.seq_gaps, fmt.int(t.seq_gaps));
      setText(totalsEl.decode_errors, fmt.int(t.decode_errors));
      setText(totalsEl.score_requests_per_s, fmt.scoreRate(t));
      setText(totalsEl.hit_rate, fmt.hitRate(t));
      setText(totalsEl.ingest_processes, fmt.int(t.ingest_processes));
      indexWarning.hidden = t.index_available !== false;
      const resyncing = t.index_resyncing || [];
      resyncWarning.hidden = resyncing.length === 0;
      setText(resyncModels, resyncing.join(", "));
    }

    function drawCharts() {
      const top = [...latestRows]
        .sort((a, b) => b.blocks - a.blocks || (a.pod < b.pod ? -1 : 1))
        .slice(0, CHART_PODS)
        .map((r) => r.pod)
        .sort();
      const t = series.t;
      blocksChart.draw(
        t,
        top.map((pod) => ({ label: pod, scale: "blocks", values: series.get("pod:" + pod), format: fmt.int })),
      );
      const requestsLabel = scoringAvailable ? "scoring requests/s" : "scoring requests/s (n/a)";
      trafficChart.draw(t, [
        { label: "events/s", scale: "rate", values: series.get("events_per_s") },
        { label: requestsLabel, scale: "rate", values: series.get("score_requests_per_s") },
        {
          label: hitRateAvailable ? "hit rate %" : "hit rate % (n/a)",
          scale: "pct",
          values: series.get("hit_rate").map((x) => (x == null ? null : x * 100)),
          dash: [6, 4],
          format: (v) => v.toFixed(1) + " %",
        },
      ]);
    }

    // Chart columns (a history message, a frame's "chart") under the names series uses.
    function chartColumns(chart) {
      const columns = {
        events_per_s: chart.events_per_s,
        score_requests_per_s: chart.score_requests_per_s,
        hit_rate: chart.hit_rate,
      };
      for (const [pod, values] of Object.entries(chart.pods)) columns["pod:" + pod] = values;
      return columns;
    }

    function onHistory(msg) {
      series.reset(msg.seconds, msg.step, msg.t, chartColumns(msg));
      if (latestRows.length) drawCharts();
    }

    function onFrame(msg) {
      latestRows = msg.pods;
      scoringAvailable = msg.totals.scoring_available;
      hitRateAvailable = msg.totals.hit_rate_available;
      const seen = new Set();
      for (const r of msg.pods) {
        seen.add(r.pod);
        let entry = rows.get(r.pod);
        if (!entry) rows.set(r.pod, (entry = makeRow(r.pod)));
        fillRow(entry, r);
      }
      for (const [pod, entry] of rows) {
        if (!seen.has(pod)) {
          entry.tr.remove();
          rows.delete(pod);
        }
      }
      arrange();
      showTotals(msg.totals);
      showGateways(msg.gateways || []);

      // The points recorded since: every pod's blocks, so that a pod entering the chart's top
      // brings its past along.
      series.extend(msg.chart.t, chartColumns(msg.chart));
      drawCharts();
    }

    const span = spanControl((seconds) => send({ history_seconds: seconds }));
    const send = connect(
      "/ws/dashboard/",
      (msg) => (msg.type === "history" ? onHistory(msg) : onFrame(msg)),
      () => (span() !== HISTORY_SECONDS ? { history_seconds: span() } : null),
    );
  }

  // ---- the pod page -----------------------------------------------------------------------

  function podPage() {
    const pod = document.getElementById("pod-heading").dataset.pod;
    const fields = Object.fromEntries(
      [...document.querySelectorAll("[data-field]")].map((el) => [el.dataset.field, el]),
    );
    const unknown = document.getElementById("pod-unknown");
    const logBody = document.getElementById("pod-log").tBodies[0];
    const logEmpty = document.getElementById("log-empty");
    const history = new Columns();
    const chart = new TimeChart(document.getElementById("chart-pod"), {
      scales: {
        blocks: { auto: true, range: (u, min, max) => [0, Math.max(max, 1)] },
        rate: { auto: true, range: (u, min, max) => [0, Math.max(max, 1)] },
      },
      axes: [{}, { scale: "blocks", label: "blocks" }, { scale: "rate", label: "per second", side: 1, grid: { show: false } }],
    });
    let logKey = "";

    function draw() {
      const c = (name) => history.get(name);
      chart.draw(history.t, [
        { label: "blocks", scale: "blocks", values: c("blocks"), format: fmt.int },
        { label: "stored/s", scale: "rate", values: c("stored_per_s") },
        { label: "removed/s", scale: "rate", values: c("removed_per_s") },
        { label: "events/s", scale: "rate", values: c("events_per_s"), dash: [6, 4] },
      ]);
    }

    function showLog(entries) {
      const key = entries.length + ":" + (entries[0] ? entries[0].at : "");
      if (key === logKey) return;
      logKey = key;
      const errors = (e) => Object.entries(e.decode_errors).map(([k, n]) => `${k} ${n}`).join(", ") || DASH;
      const cells = [
        (e) => fmt.time(e.at),
        (e) => fmt.int(e.batches),
        (e) => fmt.int(e.events),
        (e) => fmt.int(e.blocks_stored),
        (e) => fmt.int(e.blocks_removed),
        (e) => fmt.int(e.clears),
        (e) => (e.seq_gaps ? `${e.seq_gaps} (${e.missed_batches})` : "0"),
        (e) => fmt.int(e.restarts),
        (e) => fmt.int(e.orphaned_blocks),
        errors,
        (e) => (e.last_seq == null ? DASH : String(e.last_seq)),
      ];
      const trs = entries.map((e) => {
        const tr = document.createElement("tr");
        cells.forEach((cell, i) => {
          const td = document.createElement("td");
          if (i > 0 && i !== 9) td.className = "num";
          td.textContent = cell(e);
          if ((i === 6 && e.seq_gaps) || (i === 9 && Object.keys(e.decode_errors).length)) td.classList.add("bad");
          tr.append(td);
        });
        return tr;
      });
      logBody.replaceChildren(...trs);
      logEmpty.hidden = entries.length > 0;
    }

    function onFrame(msg) {
      const r = msg.pod;
      unknown.hidden = r != null;
      if (r) {
        setText(fields.status, r.status);
        fields.status.className = "status status-" + r.status;
        setText(fields.health, r.health);
        setText(fields.model, r.model || DASH);
        setText(fields.blocks, fmt.int(r.blocks));
        setText(fields.blocks_by_tier, fmt.tiers(r.blocks_by_tier));
        setText(fields.stored_per_s, fmt.rate(r.stored_per_s));
        setText(fields.removed_per_s, fmt.rate(r.removed_per_s));
        setText(fields.events_per_s, fmt.rate(r.events_per_s));
        setText(fields.last_event_age, fmt.age(r.last_event_age));
        setText(fields.seq_gaps, `${fmt.int(r.seq_gaps)} (${fmt.int(r.missed_batches)})`);
        setText(fields.restarts, fmt.int(r.restarts));
        setText(fields.decode_errors, fmt.int(r.decode_errors));
        setText(fields.hash_alignment, fmt.percent(r.hash_alignment));
        setText(fields.ranks, fmt.int(r.ranks));
      }
      const { blocks, stored_per_s, removed_per_s, events_per_s } = msg.chart;
      history.extend(msg.chart.t, { blocks, stored_per_s, removed_per_s, events_per_s });
      showLog(msg.log);
      draw();
    }

    function onHistory(msg) {
      const { blocks, stored_per_s, removed_per_s, events_per_s } = msg;
      history.reset(msg.seconds, msg.step, msg.t, { blocks, stored_per_s, removed_per_s, events_per_s });
      showLog(msg.log);
      draw();
    }

    const span = spanControl((seconds) => send({ history_seconds: seconds }));
    const send = connect(
      "/ws/dashboard/pods/" + encodeURIComponent(pod) + "/",
      (msg) => (msg.type === "history" ? onHistory(msg) : onFrame(msg)),
      () => (span() !== HISTORY_SECONDS ? { history_seconds: span() } : null),
    );
  }

  if (body.dataset.page === "fleet") fleetPage();
  else if (body.dataset.page === "pod") podPage();
})();
