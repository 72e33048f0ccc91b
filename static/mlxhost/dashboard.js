/* mlxhost staff dashboard (ADM-2, OPS-4): the live instance table, uPlot charts and load
 * progress, fed by the status frames that /ws/dashboard pushes (one per engine per second).
 * Also exports the reconnecting socket and formatters the Models page and chat use (window.mlxhost). */
(function () {
  "use strict";

  var DASH = "\u2014"; // an em dash: no value (yet)
  var HISTORY_S = 3600; // the charts' window: the last hour (the server keeps it too, status_history.py)
  var NARROW = "(max-width: 700px)"; // a phone: one kind of chart at a time, for every instance
  var ENGINE_STALE_MS = 15000; // matches STATUS_TTL_S: an engine silent this long is gone
  var BACKOFF_MIN_MS = 500;
  var BACKOFF_MAX_MS = 15000;
  // Close codes after which retrying is useless until the user signs in again.
  var DENIED = { 4401: "session ended", 4403: "forbidden" };
  var SESSION_ENDED = 4401;

  // Helpers -----------------------------------------------------------------------------------

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) {
      if (key === "text") node.textContent = attrs[key];
      else if (key === "className") node.className = attrs[key];
      else node.setAttribute(key, attrs[key]);
    });
    (children || []).forEach(function (child) {
      if (child !== null && child !== undefined) node.append(child);
    });
    return node;
  }

  function formatBytes(bytes) {
    if (!bytes) return "0 B";
    var units = ["B", "KB", "MB", "GB", "TB"];
    var i = Math.min(units.length - 1, Math.floor(Math.log(bytes) / Math.log(1024)));
    var value = bytes / Math.pow(1024, i);
    return (i === 0 ? value : value.toFixed(1)) + " " + units[i];
  }

  // How long ago, in the console's one rule (models_app/console/words.py relative_time): under
  // 5 s "just now", under a minute "12 seconds ago", then the largest unit; never "0 s ago".
  var AGO_UNITS = [[86400, "day"], [3600, "hour"], [60, "minute"]];

  function ago(seconds) {
    seconds = Math.max(0, Math.floor(seconds));
    if (seconds < 5) return "just now";
    if (seconds < 60) return seconds + "\u00a0seconds ago";
    for (var i = 0; i < AGO_UNITS.length; i++) {
      var count = Math.floor(seconds / AGO_UNITS[i][0]);
      if (count >= 1) return count + "\u00a0" + AGO_UNITS[i][1] + (count === 1 ? "" : "s") + " ago";
    }
    return "just now";
  }

  function formatNumber(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return DASH;
    return Number(value).toFixed(digits === undefined ? 1 : digits);
  }

  // Speculative decoding (docs/speculation.md): the share of drafted tokens accepted and the
  // tokens per decode pass, as a tooltip of the tokens/s cells; null (no title at all) before
  // any drafting and for an embedding model. The counts are totals since the engine started.
  function speculationTitle(view) {
    if (!view || view.speculation_acceptance == null) return null;
    return "Speculative decoding, totals since the engine started: " +
      Math.round(view.speculation_acceptance * 100) + "% of drafted tokens accepted, " +
      formatNumber(view.tokens_per_pass, 2) + " tokens per decode pass";
  }

  // The same counts in words under the tokens/s figure, where the model has drafted: a share
  // seen at a glance, the tooltip keeps the long form.
  function speculationLine(view) {
    if (!view || !view.speculation_drafted) return null;
    return "drafts: " + Math.round(view.speculation_acceptance * 100) + "% of " + view.speculation_drafted +
      " accepted \u00b7 " + formatNumber(view.tokens_per_pass, 2) + "/pass";
  }

  // Set or remove a title: never an empty title="" (a tooltip of nothing).
  function setTitle(node, title) {
    if (!node) return;
    if (title) node.title = title;
    else node.removeAttribute("title");
  }

  function withTitle(node, title) {
    setTitle(node, title);
    return node;
  }

  function socketUrl(path) {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  }

  function slug(text) {
    return String(text).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-+|-+$/g, "");
  }

  // Load progress (OPS-4), phase by phase as the engine reports them: checking the weights,
  // downloading (bytes, and the file in flight), reading (bytes), building the model in memory. Only the phases that count
  // show a percentage; the others an indeterminate bar, never "100 %" while the build runs.
  var LOAD_PHASES = {
    starting: "starting",
    verify: "checking the weights",
    download: "downloading",
    read: "reading the weights",
    build: "building the model in memory",
  };
  var COUNTED = { download: true, read: true };

  function loadProgress(progress) {
    var phase = progress.phase || (progress.total ? (progress.unit === "files" ? "download" : "read") : "starting");
    var words = LOAD_PHASES[phase] || phase;
    if (!COUNTED[phase] || !progress.total) {
      return el("div", { className: "load", "data-phase": phase }, [el("progress", {}), el("span", { className: "quiet", text: words + "\u2026" })]);
    }
    var percent = Math.max(0, Math.min(100, Math.round((100 * progress.done) / progress.total)));
    var detail = words + ": " + percent + "%";
    if (progress.unit === "bytes") detail += " (" + formatBytes(progress.done) + " of " + formatBytes(progress.total) + ")";
    else if (progress.unit === "files") detail += " (" + progress.done + " of " + progress.total + " files)";
    // A hub download names the file in flight and its own bytes (issue 28).
    if (phase === "download" && progress.file) detail += ", " + progress.file + ": " + formatBytes(progress.file_done || 0) + " of " + formatBytes(progress.file_total || 0);
    return el("div", { className: "load", "data-phase": phase }, [
      el("progress", { max: String(progress.total), value: String(progress.done), title: progress.done + " of " + progress.total }),
      el("span", { className: "quiet", text: detail }),
    ]);
  }

  // A WebSocket that reconnects with exponential backoff and reports its state ------------------

  var sockets = []; // every LiveSocket of the page, so that a session's end stops them all

  function LiveSocket(path, handlers) {
    sockets.push(this);
    this.path = path;
    this.handlers = handlers;
    this.attempt = 0;
    this.ws = null;
    this.timer = null;
    this.stopped = false;
  }

  LiveSocket.prototype.connect = function () {
    var self = this;
    clearTimeout(this.timer);
    this.stopped = false;
    this.state("connecting", "connecting\u2026");
    var ws = new WebSocket(socketUrl(this.path));
    this.ws = ws;
    ws.addEventListener("open", function () {
      self.attempt = 0;
      self.state("open", "live");
      if (self.handlers.onOpen) self.handlers.onOpen();
    });
    ws.addEventListener("message", function (event) {
      var frame;
      try {
        frame = JSON.parse(event.data);
      } catch (err) {
        return;
      }
      self.handlers.onMessage(frame);
    });
    ws.addEventListener("close", function (event) {
      if (self.ws !== ws) return;
      self.ws = null;
      if (self.handlers.onClose) self.handlers.onClose(event);
      if (event.code === SESSION_ENDED) {
        self.state("denied", "not live: the session ended");
        endSession();
        return;
      }
      if (DENIED[event.code]) {
        self.state("denied", DENIED[event.code] + " (" + event.code + "): reload the page after signing in");
        return;
      }
      if (self.stopped || self.handlers.reconnect === false) {
        self.state("closed", "closed");
        return;
      }
      self.retry();
    });
  };

  LiveSocket.prototype.retry = function () {
    var self = this;
    var delay = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * Math.pow(2, this.attempt));
    delay = Math.round(delay * (0.8 + Math.random() * 0.4)); // jitter: don't reconnect in lockstep
    this.attempt += 1;
    var until = Date.now() + delay;
    var tick = function () {
      var left = Math.max(0, Math.ceil((until - Date.now()) / 1000));
      self.state("reconnecting", "disconnected, retrying in " + left + " s");
      if (Date.now() >= until) self.connect();
      else self.timer = setTimeout(tick, Math.min(1000, until - Date.now()));
    };
    tick();
  };

  LiveSocket.prototype.isOpen = function () {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  };

  LiveSocket.prototype.send = function (payload) {
    if (!this.isOpen()) return false;
    this.ws.send(JSON.stringify(payload));
    return true;
  };

  LiveSocket.prototype.state = function (name, text) {
    if (this.handlers.onState) this.handlers.onState(name, text);
  };

  function showState(node, name, text) {
    node.dataset.state = name;
    node.textContent = text;
  }

  // The session ended (a logout here or in another tab, or its expiry): a socket closed with 4401,
  // or an action answered 401. Say so once, with a link to log in again, and turn every control of
  // the page off; the pages' renders keep them off (sessionEnded()), and stop blaming the engines.
  var ended = false;

  function loginUrl() {
    var meta = document.querySelector('meta[name="mlxhost-login-url"]');
    var base = meta ? meta.getAttribute("content") : "/admin/login/";
    return base + "?next=" + encodeURIComponent(location.pathname + location.search);
  }

  function endSession() {
    if (ended) return;
    ended = true;
    document.body.dataset.session = "ended";
    var banner = el("div", { id: "session-ended", className: "session-ended", role: "alert" }, [
      el("strong", { text: "Your session has ended" }),
      " (you logged out, here or in another tab, or it expired). Nothing on this page acts until you ",
      el("a", { href: loginUrl(), id: "session-login", text: "log in again" }),
      ".",
    ]);
    var content = document.getElementById("content") || document.body;
    content.prepend(banner);
    sockets.forEach(function (socket) {
      var ws = socket.ws;
      socket.stopped = true;
      socket.ws = null; // its close handler ignores a socket it no longer holds
      clearTimeout(socket.timer);
      if (ws) ws.close();
      socket.state("denied", "not live: the session ended");
    });
    disableControls();
    window.dispatchEvent(new CustomEvent("mlxhost:session-ended"));
  }

  function disableControls() {
    document.querySelectorAll("#content button, #content input, #content select, #content textarea").forEach(function (node) {
      if (!node.closest("#session-ended")) node.disabled = true;
    });
  }

  function sessionEnded() {
    return ended;
  }

  window.mlxhost = {
    endSession: endSession,
    sessionEnded: sessionEnded,
    disableControls: disableControls,
    LiveSocket: LiveSocket,
    el: el,
    ago: ago,
    formatBytes: formatBytes,
    formatNumber: formatNumber,
    speculationTitle: speculationTitle,
    speculationLine: speculationLine,
    setTitle: setTitle,
    roundBytes: roundBytes,
    byteSteps: function () { return BYTE_STEPS; }, // the memory axis's tick increments
    loadProgress: loadProgress,
    showState: showState,
    slug: slug,
  };

  // The live table and charts -------------------------------------------------------------------

  function Dashboard(root) {
    this.root = root;
    this.body = document.getElementById("instances-body");
    this.empty = document.getElementById("instances-empty");
    this.summary = document.getElementById("engines-summary");
    this.actions = document.getElementById("actions-list");
    this.grid = document.getElementById("charts-grid");
    this.engines = new Map(); // boot_id -> {status, seen}
    this.series = new Map(); // row key -> {t, one array per SAMPLE_FIELDS name, charts, card}
  }

  Dashboard.prototype.start = function () {
    var self = this;
    var initial = document.getElementById("initial-status");
    var statuses = initial ? JSON.parse(initial.textContent) : [];
    var history = document.getElementById("status-history");
    var samples = history ? JSON.parse(history.textContent) : {};
    Object.keys(samples).forEach(function (bootId) {
      samples[bootId].forEach(function (sampled) {
        self.addPoints(bootId, sampled.at, sampled.instances);
      });
    });
    this.pickCharts();
    statuses.forEach(function (status) {
      self.update(status, false);
    });
    this.render();
    var stateNode = document.getElementById("ws-state");
    this.socket = new LiveSocket(this.root.dataset.wsPath, {
      onMessage: function (frame) {
        if (frame.type === "status" && frame.status) self.update(frame.status, true);
        self.render();
      },
      onState: function (name, text) {
        showState(stateNode, name, text);
      },
    });
    this.socket.connect();
    setInterval(function () {
      self.render();
    }, 1000);
    window.addEventListener("resize", function () {
      self.resizeCharts();
    });
  };

  Dashboard.prototype.update = function (status, live) {
    var self = this;
    // The server only renders engines that reported lately; count from now, whatever the clocks say.
    this.engines.set(status.boot_id, { status: status, seen: Date.now() });
    if (!live) return;
    this.addPoints(status.boot_id, status.at, status.instances).forEach(function (pair) {
      pair[0].view = pair[1]; // a full view: the chart card's title comes from it
    });
  };

  // One point per instance at `at` (a live report, or a sample of the server's history).
  Dashboard.prototype.addPoints = function (bootId, at, views) {
    var self = this;
    return views.map(function (view) {
      var key = bootId + ":" + view.instance_id;
      var data = self.series.get(key);
      if (!data) {
        data = { t: [], charts: null, card: null };
        SAMPLE_FIELDS.forEach(function (name) {
          data[name] = [];
        });
        self.series.set(key, data);
      }
      // A reconnect replays the last report: keep x strictly increasing for uPlot.
      if (data.t.length && data.t[data.t.length - 1] >= at) return [data, view];
      data.t.push(at);
      var point = sample(view);
      SAMPLE_FIELDS.forEach(function (name) {
        data[name].push(point[name]);
      });
      while (data.t.length && data.t[0] < at - HISTORY_S) {
        ["t"].concat(SAMPLE_FIELDS).forEach(function (name) {
          data[name].shift();
        });
      }
      return [data, view];
    });
  };

  // On a phone the charts of every instance would make a page thousands of pixels tall: show one
  // kind at a time (the user picks which); a wider screen shows every chart, and may pick too.
  Dashboard.prototype.pickCharts = function () {
    var self = this;
    var picker = document.getElementById("chart-pick");
    if (!picker) return;
    document.getElementById("chart-pick-row").hidden = false;
    if (window.matchMedia && window.matchMedia(NARROW).matches) picker.value = "0";
    var show = function () {
      self.grid.dataset.show = picker.value;
      self.resizeCharts(); // a chart shown again takes its box's width
    };
    picker.addEventListener("change", show);
    show();
  };

  Dashboard.prototype.render = function () {
    var self = this;
    var now = Date.now();
    var live = new Set();
    var rows = [];
    var actions = {};
    this.engines.forEach(function (entry, bootId) {
      if (now - entry.seen > ENGINE_STALE_MS) {
        self.engines.delete(bootId);
        return;
      }
      var status = entry.status;
      status.instances.forEach(function (view) {
        var key = bootId + ":" + view.instance_id;
        live.add(key);
        rows.push({ key: key, status: status, view: view });
      });
      Object.keys(status.actions || {}).forEach(function (name) {
        var action = status.actions[name];
        if (!actions[name] || action.at > actions[name].at) actions[name] = action;
      });
    });
    this.renderRows(rows, live);
    this.renderCharts(live);
    this.renderActions(actions);
    this.renderAliases(rows);
    this.renderSummary(now);
  };

  Dashboard.prototype.renderRows = function (rows, live) {
    var self = this;
    Array.prototype.slice.call(this.body.rows).forEach(function (tr) {
      if (!live.has(tr.dataset.key)) tr.remove();
    });
    rows.forEach(function (row) {
      var tr = self.body.querySelector('tr[data-key="' + CSS.escape(row.key) + '"]');
      if (!tr) {
        tr = el("tr", { "data-key": row.key, "data-instance-id": String(row.view.instance_id) });
        self.body.append(tr);
      }
      self.fillRow(tr, row.status, row.view);
    });
    this.empty.hidden = rows.length > 0;
  };

  Dashboard.prototype.fillRow = function (tr, status, view) {
    var label = view.label; // the engine's status publisher names the state (models_app.catalogue.live_status)
    tr.className = "state-" + view.state;
    var state = el("td", { className: "state" }, [el("span", { className: "badge badge-" + slug(label), text: label })]);
    if (view.state === "loading") state.append(loadProgress(view.load_progress || { done: 0, total: 0 }));
    if (view.error) state.append(el("div", { className: "error-text", text: view.error }));
    var lane = view.active + " / " + view.queued + " / " + view.capacity;
    var point = sample(view);
    var ttft =
      point.ttft === null
        ? [DASH]
        : [formatNumber(point.ttft) + " ", el("span", { className: "quiet", text: "(queue " + formatNumber(point.queue_ms) + ")" })];
    state.dataset.label = "State";
    tr.replaceChildren(
      el("td", { className: "num mono", "data-label": "Instance" }, [
        "#" + view.instance_id,
        el("div", { className: "quiet", text: engineName(status) + " \u00b7 pid " + status.pid }),
      ]),
      el("td", { className: "aliases", "data-label": "Aliases", text: view.aliases.length ? view.aliases.join(", ") : DASH }),
      el("td", { className: "kind", "data-label": "Kind", text: view.kind || "chat" }),
      state,
      el("td", { className: "num lane", "data-label": "Active / queued / capacity", text: lane + (view.draining ? " (draining)" : "") }),
      withTitle(
        el("td", { className: "num tps", "data-label": "Tokens/s" }, [
          formatNumber(view.tokens_per_s),
          speculationLine(view) ? el("div", { className: "quiet speculation", text: speculationLine(view) }) : null,
        ]),
        speculationTitle(view)
      ),
      el("td", { className: "num ttft", "data-label": "TTFT (ms, incl. queue)" }, ttft),
      el("td", {
        className: "num warm",
        "data-label": "Prefix cache",
        title: (view.cache_tokens_saved || 0) + " prompt tokens saved",
        text: String(view.warm_sessions) + (view.cache_hit_rate == null ? "" : " \u00b7 " + Math.round(view.cache_hit_rate * 100) + "% hits"),
      }),
      el("td", { className: "num warm-bytes", "data-label": "Cache bytes" }, [
        formatBytes(view.warm_bytes),
        view.disk_entries == null
          ? null
          : el("div", { className: "quiet", text: "disk: " + view.disk_entries + " \u00b7 " + formatBytes(view.disk_bytes) }),
      ]),
      el("td", { className: "num memory", "data-label": "Memory", text: view.state === "loading" ? DASH : formatBytes(view.memory_bytes) })
    );
  };

  Dashboard.prototype.renderAliases = function (rows) {
    var byAlias = {};
    rows.forEach(function (row) {
      row.view.aliases.forEach(function (name) {
        byAlias[name] = row.view;
      });
    });
    var table = document.getElementById("aliases-table");
    var noInstance = table ? table.dataset.noInstanceLabel : "";
    document.querySelectorAll("#aliases-table tr[data-alias]").forEach(function (tr) {
      var view = byAlias[tr.dataset.alias];
      var cell = tr.querySelector(".alias-state");
      var label = view ? view.label : noInstance;
      cell.replaceChildren(el("span", { className: "badge badge-" + slug(label), text: label }));
    });
  };

  Dashboard.prototype.renderActions = function (actions) {
    var names = Object.keys(actions).sort(function (a, b) {
      return actions[b].at - actions[a].at;
    });
    if (!names.length) return; // keep the server's first paint until an engine reports one
    this.actions.replaceChildren.apply(
      this.actions,
      names.map(function (name) {
        var action = actions[name];
        var when = new Date(action.at * 1000).toLocaleTimeString();
        return el("li", { "data-model": name, className: "action-" + action.state }, [
          el("strong", { text: action.action }),
          " " + name + ": " + action.state + " at " + when,
          action.error ? el("span", { className: "error-text", text: " " + action.error }) : null,
        ]);
      })
    );
  };

  // A fleet host by its number (h01, MLXHOST_HOST_ID), any other engine by its machine's name.
  function engineName(status) {
    var id = status.host_id;
    return id === null || id === undefined ? status.host : "h" + (id < 10 ? "0" : "") + id;
  }

  Dashboard.prototype.renderSummary = function (now) {
    var parts = [];
    var total = { active: 0, queued: 0, capacity: 0, memory: 0 };
    this.engines.forEach(function (entry) {
      parts.push(engineName(entry.status) + " pid " + entry.status.pid + " (updated " + ago((now - entry.seen) / 1000) + ")");
      entry.status.instances.forEach(function (view) {
        total.active += view.active || 0;
        total.queued += view.queued || 0;
        total.capacity += view.capacity || 0;
        total.memory += view.memory_bytes || 0;
      });
    });
    var fleet =
      parts.length > 1
        ? ". Fleet total: " + total.active + " active / " + total.queued + " queued / " + total.capacity +
          " capacity, " + formatNumber(total.memory / 1048576) + " MiB of weights"
        : "";
    if (ended) {
      this.summary.textContent = "Figures stopped when the session ended.";
      return;
    }
    this.summary.textContent = parts.length
      ? parts.length + (parts.length === 1 ? " engine: " : " engines: ") + parts.join("; ") + fleet
      : "no engine has reported in the last 15 s";
  };

  // Charts: per instance, five uPlot charts with units on their axes -----------------------------

  var RESIDENT = { resident: true, degraded: true }; // control.RESIDENT_STATES
  // One point per report. The first-token time is the last finished request's; it counts from when
  // the request entered the lane, so it includes the queue wait (`queue_ms`, drawn apart). Both are
  // blank (null: a gap) while the weights are not resident, rather than a stale figure.
  var SAMPLE_FIELDS = ["tps", "queued", "active", "ttft", "queue_ms", "memory", "cache_bytes", "hits"];

  function sample(view) {
    var up = RESIDENT[view.live_state] === true;
    var ttft = up && view.ttft_ms > 0 ? view.ttft_ms : null;
    return {
      tps: view.tokens_per_s,
      queued: view.queued,
      active: view.active,
      ttft: ttft,
      queue_ms: ttft === null ? null : Math.min(view.queue_ms || 0, ttft),
      memory: view.memory_bytes,
      cache_bytes: view.warm_bytes,
      hits: up && view.cache_hit_rate != null ? Math.round(view.cache_hit_rate * 1000) / 10 : null,
    };
  }

  function pad(n) {
    return (n < 10 ? "0" : "") + n;
  }

  function clock(seconds) {
    var d = new Date(seconds * 1000);
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  var COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];
  var TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800]; // seconds between time labels
  // Bytes between memory ticks: 1, 2, 5, 10, 20, 50, 100, 200, 500 of each unit formatBytes shows
  // (1024-based), so a tick reads "200 MB", never "190.7 MB".
  var BYTE_STEPS = [];
  [1, 1024, Math.pow(1024, 2), Math.pow(1024, 3), Math.pow(1024, 4)].forEach(function (unit) {
    [1, 2, 5, 10, 20, 50, 100, 200, 500].forEach(function (m) { BYTE_STEPS.push(m * unit); });
  });

  function roundBytes(v) {
    return formatBytes(v).replace(/\.0 /, " "); // a tick is a round value: "200 MB"
  }

  // Each chart: its title (with the unit), y-axis label and format, and the series it draws.
  var CHARTS = [
    {
      title: "Tokens per second (tokens/s)",
      unit: "tokens/s",
      format: function (v) {
        return formatNumber(v, v >= 100 ? 0 : 1);
      },
      series: [{ label: "generated", field: "tps", stroke: "#417690", fill: "rgba(65,118,144,0.15)" }],
      // An embedding model's tokens/s are the input tokens it embeds.
      embedding: { title: "Tokens per second (tokens/s): input tokens embedded", series: [{ label: "input", field: "tps", stroke: "#417690", fill: "rgba(65,118,144,0.15)" }] },
    },
    {
      title: "Queued and running (requests)",
      unit: "requests",
      integer: true,
      format: function (v) {
        return String(Math.round(v));
      },
      series: [
        { label: "queued", field: "queued", stroke: "#ba2121", stepped: true },
        { label: "running", field: "active", stroke: "#79aec8", stepped: true },
      ],
    },
    {
      title: "Time to first token (ms): last request, queue wait included",
      unit: "ms",
      chatOnly: "an embedding model generates no tokens, so has no first token",
      format: function (v) {
        return formatNumber(v, v >= 100 ? 0 : 1);
      },
      series: [
        { label: "first token (incl. queue)", field: "ttft", stroke: "#417690", points: true },
        { label: "of which queue wait", field: "queue_ms", stroke: "#c99500", points: true },
      ],
    },
    {
      title: "Memory (bytes)",
      unit: "bytes",
      bytes: true,
      format: formatBytes,
      series: [
        { label: "weights", field: "memory", stroke: "#417690", fill: "rgba(65,118,144,0.12)" },
        { label: "prefix cache", field: "cache_bytes", stroke: "#2e8540" },
      ],
    },
    {
      title: "Prefix-cache hit rate (%) of all lookups so far",
      unit: "%",
      chatOnly: "an embedding model keeps no prefix cache",
      percent: true,
      format: function (v) {
        return Math.round(v) + "%";
      },
      series: [{ label: "hit rate", field: "hits", stroke: "#2e8540" }],
    },
  ];

  // The charts of an instance of `kind`: an embedding model's say what its tokens/s count, and
  // those that can never hold data for it (first token, prefix cache) say "not applicable".
  function chartsFor(kind) {
    if (kind !== "embedding") return CHARTS;
    return CHARTS.map(function (spec) {
      if (spec.chatOnly) return Object.assign({}, spec, { notApplicable: spec.chatOnly });
      return spec.embedding ? Object.assign({}, spec, spec.embedding) : spec;
    });
  }

  function chartColors() {
    var css = getComputedStyle(document.documentElement);
    return {
      fg: css.getPropertyValue("--body-quiet-color").trim() || "#666",
      grid: css.getPropertyValue("--hairline-color").trim() || "#e8e8e8",
    };
  }

  function yRange(spec) {
    return function (_u, _min, max) {
      if (spec.percent) return [0, 100];
      var top = Math.max(spec.integer ? 2 : 1, max || 0);
      return [0, spec.integer ? Math.ceil(top) : top * 1.1];
    };
  }

  function makeChart(target, spec) {
    var colors = chartColors();
    var axis = { stroke: colors.fg, grid: { stroke: colors.grid, width: 1 }, ticks: { stroke: colors.grid } };
    var x = Object.assign({}, axis, {
      space: 72, // pixels between time labels, so "12:34:56" never overlaps its neighbour
      incrs: TIME_STEPS,
      values: function (_u, splits) {
        return splits.map(clock);
      },
    });
    var y = Object.assign({}, axis, {
      label: spec.unit,
      labelSize: 18,
      size: spec.bytes ? 64 : 48,
      space: 28,
      values: function (_u, splits) {
        return splits.map(spec.bytes ? roundBytes : spec.format);
      },
    });
    if (spec.integer) y.incrs = COUNT_STEPS; // whole requests: no 0.5 steps
    if (spec.bytes) y.incrs = BYTE_STEPS;
    var opts = {
      width: Math.max(200, target.clientWidth),
      height: 200,
      scales: { x: { time: true }, y: { range: yRange(spec) } },
      axes: [x, y],
      cursor: { drag: { x: false, y: false } },
      legend: { live: false },
      series: [{ value: function (_u, v) { return v == null ? DASH : clock(v); } }].concat(
        spec.series.map(function (s) {
          var series = { label: s.label, stroke: s.stroke, width: 2, fill: s.fill, value: function (_u, v) { return v == null ? DASH : spec.format(v); } };
          if (s.stepped && window.uPlot.paths && window.uPlot.paths.stepped) series.paths = window.uPlot.paths.stepped({ align: 1 });
          if (s.points) series.points = { show: true, size: 4 };
          return series;
        })
      ),
    };
    return new window.uPlot(opts, [[]].concat(spec.series.map(function () { return []; })), target);
  }

  Dashboard.prototype.renderCharts = function (live) {
    var self = this;
    if (!window.uPlot) return;
    this.series.forEach(function (data, key) {
      if (!live.has(key)) {
        if (data.charts) data.charts.forEach(function (chart) { if (chart) chart.destroy(); });
        if (data.card) data.card.remove();
        self.series.delete(key);
        return;
      }
      if (!data.view) return; // first paint only: wait for live points
      if (!data.card) {
        data.specs = chartsFor(data.view.kind);
        var boxes = data.specs.map(function (spec, i) {
          var caption = [el("figcaption", { text: spec.title })];
          if (spec.notApplicable) caption.push(el("p", { className: "quiet chart-na", text: "Not applicable: " + spec.notApplicable + "." }));
          return el("figure", { className: "chart", "data-unit": spec.unit, "data-chart": String(i) }, caption);
        });
        data.title = el("h3", {});
        data.card = el("div", { className: "chart-card", "data-key": key }, [data.title, el("div", { className: "charts-grid" }, boxes)]);
        self.grid.append(data.card);
        data.charts = data.specs.map(function (spec, i) {
          return spec.notApplicable ? null : makeChart(boxes[i], spec);
        });
      }
      var aliases = data.view.aliases.length ? data.view.aliases.join(", ") : "unbound";
      data.title.textContent = "#" + data.view.instance_id + " " + aliases + " \u00b7 " + data.view.label;
      data.card.dataset.points = String(data.t.length); // how much history the charts hold
      data.charts.forEach(function (chart, i) {
        if (chart) chart.setData([data.t].concat(data.specs[i].series.map(function (s) { return data[s.field]; })));
      });
    });
  };

  Dashboard.prototype.resizeCharts = function () {
    this.series.forEach(function (data) {
      (data.charts || []).forEach(function (chart) {
        if (!chart) return;
        var width = chart.root.parentNode.clientWidth;
        if (width > 0) chart.setSize({ width: width, height: chart.height });
      });
    });
  };

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("dashboard");
    if (root) new Dashboard(root).start();
  });
})();
