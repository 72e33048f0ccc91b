/* mlxhost Models page (ADM-7, OPS-4): every model's row re-rendered from the status frames that
 * /ws/dashboard pushes, and load / unload / reload sent without leaving the page. An unload asks
 * first, naming every alias it takes down. Uses the socket and helpers of dashboard.js. */
(function () {
  "use strict";

  var DASH = "\u2014";
  var ENGINE_STALE_MS = 15000; // matches STATUS_TTL_S: an engine silent this long is gone
  var PENDING_MS = 15000; // a requested action the engines have not picked up yet

  function readJson(id, fallback) {
    var node = document.getElementById(id);
    return node ? JSON.parse(node.textContent) : fallback;
  }

  function intersects(a, b) {
    return a.some(function (name) {
      return b.indexOf(name) !== -1;
    });
  }

  function SessionEnded() {}

  // A fetch that followed a redirect to the login page: the session is gone.
  function isLoginPage(response) {
    return response.redirected && /\/login\/?$/.test(new URL(response.url).pathname);
  }

  function ModelsPage(root) {
    this.root = root;
    this.body = document.getElementById("models-body");
    this.summary = document.getElementById("engines-summary");
    this.feedback = document.getElementById("action-feedback");
    this.dialog = document.getElementById("unload-dialog");
    this.models = readJson("models-data", []);
    this.page = readJson("models-page-data", { actions_by_state: {}, labels: {} });
    this.engines = new Map(); // boot_id -> {status, seen}
    this.pending = new Map(); // model name -> {action, since (the engine's last action time), until}
  }

  ModelsPage.prototype.start = function () {
    var self = this;
    readJson("initial-status", []).forEach(function (status) {
      self.engines.set(status.boot_id, { status: status, seen: Date.now() });
    });
    this.render();
    var stateNode = document.getElementById("ws-state");
    this.socket = new window.mlxhost.LiveSocket(this.root.dataset.wsPath, {
      onMessage: function (frame) {
        if (frame.type === "status" && frame.status) {
          self.engines.set(frame.status.boot_id, { status: frame.status, seen: Date.now() });
        }
        self.render();
      },
      onState: function (name, text) {
        window.mlxhost.showState(stateNode, name, text);
      },
    });
    this.socket.connect();
    setInterval(function () {
      self.render();
    }, 1000);
    this.body.addEventListener("submit", function (event) {
      var form = event.target.closest("form.model-action");
      if (!form) return;
      event.preventDefault();
      self.ask(form);
    });
  };

  // What the engines report, merged: instance views by id, and the latest action per model.
  ModelsPage.prototype.collect = function () {
    var self = this;
    var now = Date.now();
    var views = new Map();
    var actions = {};
    this.engines.forEach(function (entry, bootId) {
      if (now - entry.seen > ENGINE_STALE_MS) {
        self.engines.delete(bootId);
        return;
      }
      entry.status.instances.forEach(function (view) {
        views.set(view.instance_id, view);
      });
      Object.keys(entry.status.actions || {}).forEach(function (name) {
        var action = entry.status.actions[name];
        if (!actions[name] || action.at > actions[name].at) actions[name] = action;
      });
    });
    return { views: views, actions: actions, reporting: this.engines.size > 0 };
  };

  // The instance serving a model: what an engine serves under its aliases (a swap may be ahead of
  // the page), else its registered instance. The same rule as live_state.model_live_state.
  function viewFor(model, views) {
    var bound = [];
    views.forEach(function (view) {
      if (intersects(model.aliases, view.aliases || [])) bound.push(view);
    });
    for (var i = 0; i < bound.length; i++) {
      if (bound[i].instance_id === model.instance_id) return bound[i];
    }
    if (bound.length) return bound[0];
    return model.instance_id === null ? null : views.get(model.instance_id) || null;
  }

  // The latest event: the last admin action, unless the live state says something happened since
  // (as models_app/catalogue/selectors.py _action_text words it).
  var IN_MEMORY = { loading: true, resident: true, degraded: true };

  function actionText(result, liveState) {
    if (!result) return { text: "", state: "" };
    if (result.state === "failed") return { text: result.action + " failed: " + (result.error || "no reason given"), state: "failed" };
    if (result.state === "done" && result.action === "unload" && IN_MEMORY[liveState]) return { text: "loaded on demand since the unload", state: "done" };
    if (result.state === "done" && (result.action === "load" || result.action === "reload") && liveState === "unloaded") {
      return { text: "unloaded since the " + result.action, state: "done" };
    }
    return { text: result.action + " " + result.state, state: result.state };
  }

  ModelsPage.prototype.liveState = function (model, live) {
    var labels = this.page.labels;
    var view = live.reporting ? viewFor(model, live.views) : null;
    var state = !live.reporting ? "unreported" : view ? view.live_state : "unloaded";
    var action = actionText(live.actions[model.name], state);
    var allowed = action.state === "running" ? [] : this.page.actions_by_state[state] || [];
    var pending = this.pending.get(model.name);
    var label = view ? view.label : labels[state] || state;
    if (pending) {
      var result = live.actions[model.name];
      var pickedUp = result && result.at > pending.since;
      if (pickedUp || Date.now() > pending.until) this.pending.delete(model.name);
      else {
        allowed = [];
        label = pending.action + " requested\u2026"; // until an engine picks it up, not "not loaded"
      }
    }
    this.settleFeedback(model.name, live.actions[model.name]);
    return {
      state: state,
      label: label,
      view: view,
      resident: view !== null && ["unloaded", "unreported"].indexOf(state) === -1,
      action: action,
      allowed: allowed,
    };
  };

  ModelsPage.prototype.render = function () {
    var self = this;
    var live = this.collect();
    this.models.forEach(function (model) {
      var tr = self.body.querySelector('tr[data-model-id="' + model.id + '"]');
      if (tr) self.fillRow(tr, model, self.liveState(model, live));
    });
    this.renderSummary();
  };

  function setText(tr, selector, text) {
    var node = tr.querySelector(selector);
    if (node && node.textContent !== text) node.textContent = text;
  }

  ModelsPage.prototype.fillRow = function (tr, model, live) {
    var h = window.mlxhost;
    var view = live.view;
    tr.className = "state-" + live.state;
    var cell = tr.querySelector("td.state");
    var parts = [h.el("span", { className: "badge badge-" + h.slug(live.label), text: live.label })];
    if (live.state === "loading") parts.push(h.loadProgress((view && view.load_progress) || { done: 0, total: 0 }));
    if (view && view.error && live.state === "error") parts.push(h.el("div", { className: "error-text", text: view.error }));
    parts.push(h.el("div", { className: "last-action quiet action-" + live.action.state, text: live.action.text ? "last: " + live.action.text : "" }));
    cell.replaceChildren.apply(cell, parts);
    var instanceId = view ? view.instance_id : model.instance_id;
    setText(tr, ".instance", instanceId ? "#" + instanceId : "");
    setText(tr, ".memory", live.resident ? h.formatBytes(view.memory_bytes) : DASH);
    setText(tr, ".unload", (view && view.unload_label) || DASH);
    setText(tr, ".lane", live.resident ? view.active + " / " + view.queued + " / " + view.capacity : DASH);
    var tps = tr.querySelector(".tps");
    var drafts = live.resident ? h.speculationLine(view) : null;
    if (tps) {
      tps.replaceChildren(live.resident ? h.formatNumber(view.tokens_per_s) : DASH);
      if (drafts) tps.append(h.el("div", { className: "quiet speculation", text: drafts }));
    }
    h.setTitle(tr.querySelector(".tps"), live.resident ? h.speculationTitle(view) : null);
    var hits = live.resident && view.cache_hit_rate != null ? Math.round(view.cache_hit_rate * 100) + "%" : DASH;
    setText(tr, ".hits", hits);
    tr.querySelectorAll("form.model-action button[name=action]").forEach(function (button) {
      button.disabled = window.mlxhost.sessionEnded() || live.allowed.indexOf(button.value) === -1;
    });
    tr.dataset.serving = JSON.stringify(this.serving(model, view));
  };

  // Every alias an unload takes down: the model's enabled aliases and whatever else the engine
  // serves from the same instance.
  ModelsPage.prototype.serving = function (model, view) {
    var names = model.serving.slice();
    ((view && view.aliases) || []).forEach(function (name) {
      if (names.indexOf(name) === -1) names.push(name);
    });
    return names;
  };

  ModelsPage.prototype.renderSummary = function () {
    var now = Date.now();
    var parts = [];
    this.engines.forEach(function (entry) {
      parts.push(entry.status.host + " pid " + entry.status.pid + " (updated " + window.mlxhost.ago((now - entry.seen) / 1000) + ")");
    });
    if (window.mlxhost.sessionEnded()) {
      this.summary.textContent = "Not live: the session ended, and actions are off until you log in again.";
      return;
    }
    this.summary.textContent = parts.length
      ? parts.length + (parts.length === 1 ? " engine: " : " engines: ") + parts.join("; ")
      : "no engine has reported in the last 15 s: actions are off until one does";
  };

  // Actions ------------------------------------------------------------------------------------

  ModelsPage.prototype.ask = function (form) {
    var self = this;
    var button = form.querySelector("button[name=action]");
    if (!button || button.disabled || window.mlxhost.sessionEnded()) return;
    var tr = form.closest("tr");
    if (button.value !== "unload") {
      this.send(form, tr, false);
      return;
    }
    var names = JSON.parse(tr.dataset.serving || "[]");
    var h = window.mlxhost;
    this.dialog.querySelector('[data-fill="model"]').textContent = tr.dataset.model;
    var list = this.dialog.querySelector('[data-fill="aliases"]');
    list.replaceChildren.apply(
      list,
      names.length
        ? names.map(function (name) {
            return h.el("li", {}, [h.el("code", { text: name })]);
          })
        : [h.el("li", { className: "quiet", text: "no enabled alias" })]
    );
    this.dialog.returnValue = "";
    this.dialog.addEventListener(
      "close",
      function () {
        if (self.dialog.returnValue === "confirm") self.send(form, tr, true);
      },
      { once: true }
    );
    this.dialog.showModal();
    this.dialog.querySelector("button[value=cancel]").focus(); // the safe choice first
  };

  ModelsPage.prototype.send = function (form, tr, confirmed) {
    var self = this;
    var action = form.querySelector("button[name=action]").value;
    var body = new FormData(form);
    if (confirmed) body.append("confirmed", "1");
    var last = this.collect().actions[tr.dataset.model];
    this.pending.set(tr.dataset.model, { action: action, since: last ? last.at : 0, until: Date.now() + PENDING_MS });
    this.render();
    // getAttribute: `form.action` would be the button named "action".
    fetch(form.getAttribute("action"), { method: "POST", body: body, headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (response) {
        return response
          .json()
          .catch(function () {
            return {};
          })
          .then(function (data) {
            // 401: the session ended (the server answers a script so, not with the login page).
            if (response.status === 401 || isLoginPage(response)) throw new SessionEnded();
            if (!response.ok) throw new Error(data.message || response.status + " " + response.statusText);
            if (!data.message) throw new Error("the server's answer did not say (" + response.status + ")");
            self.say(data.message + " The row follows it live.", "ok");
            self.asked = { model: tr.dataset.model, action: action, since: last ? last.at : 0 };
          });
      })
      .catch(function (error) {
        self.pending.delete(tr.dataset.model);
        if (error instanceof SessionEnded) {
          window.mlxhost.endSession();
          self.say("Nothing was sent: your session has ended. Log in again, then retry.", "error");
          self.render();
          return;
        }
        self.say("Could not request " + action + " of " + tr.dataset.model + ": " + error.message, "error");
        self.render();
      });
  };

  // The "requested" line stands while the action runs; when it ends, the line says how.
  ModelsPage.prototype.settleFeedback = function (name, result) {
    var asked = this.asked;
    if (!asked || asked.model !== name || !result || result.at <= asked.since) return;
    if (result.state !== "done" && result.state !== "failed") return;
    this.asked = null;
    var what = asked.action.charAt(0).toUpperCase() + asked.action.slice(1) + " of " + name;
    if (result.state === "failed") this.say(what + " failed: " + (result.error || "no reason given"), "error");
    else this.say(what + " done.", "ok");
  };

  ModelsPage.prototype.say = function (text, kind) {
    this.feedback.hidden = false;
    this.feedback.dataset.kind = kind;
    this.feedback.textContent = text;
  };

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("models-page");
    if (root && window.mlxhost) new ModelsPage(root).start();
  });
})();
