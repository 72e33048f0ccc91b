/* mlxhost playground (ADM-2, API-3): one conversation streamed over /ws/v1/responses.
 * The socket is signed in by this page's session (the server checks its Origin). Shows the
 * queue position, client-side TTFT (send -> first delta), tokens/s, the session-cache outcome
 * and cached tokens; a finished turn's id becomes the next turn's previous_response_id. */
(function () {
  "use strict";

  var DASH = "\u2014"; // an em dash: no value (yet)
  var CONTINUABLE = { completed: true, incomplete: true, cancelled: true };

  function Playground(root, lib) {
    this.lib = lib;
    this.root = root;
    this.form = document.getElementById("playground-form");
    this.model = document.getElementById("pg-model");
    this.instructions = document.getElementById("pg-instructions");
    this.input = document.getElementById("pg-input");
    this.send = document.getElementById("pg-send");
    this.cancel = document.getElementById("pg-cancel");
    this.reset = document.getElementById("pg-new");
    this.queue = document.getElementById("pg-queue");
    this.error = document.getElementById("pg-error");
    this.transcript = document.getElementById("pg-transcript");
    this.conversation = document.getElementById("pg-conversation");
    this.numbers = {
      temperature: document.getElementById("pg-temperature"),
      top_p: document.getElementById("pg-top-p"),
      max_output_tokens: document.getElementById("pg-max-output-tokens"),
    };
    this.turn = null;
    this.previousId = null;
  }

  Playground.prototype.start = function () {
    var self = this;
    var stateNode = document.getElementById("pg-socket");
    this.socket = new this.lib.LiveSocket(this.root.dataset.wsPath, {
      onMessage: function (frame) {
        self.onFrame(frame);
      },
      onState: function (name, text) {
        self.lib.showState(stateNode, name, text);
        self.buttons();
      },
      onClose: function () {
        if (self.turn) self.endTurn("failed", "The connection dropped; the server cancelled this turn.");
      },
    });
    this.socket.connect();
    this.form.addEventListener("submit", function (event) {
      event.preventDefault();
      self.create();
    });
    this.input.addEventListener("keydown", function (event) {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        self.form.requestSubmit();
      }
    });
    this.cancel.addEventListener("click", function () {
      self.cancelTurn();
    });
    this.reset.addEventListener("click", function () {
      self.newConversation("new conversation");
    });
    this.model.addEventListener("change", function () {
      self.defaults();
      if (self.previousId) self.newConversation("new conversation (model changed)");
    });
    this.defaults();
    this.buttons();
  };

  // Sending and cancelling ------------------------------------------------------------------------

  Playground.prototype.body = function (text) {
    var body = { type: "response.create", model: this.model.value, input: text };
    if (this.instructions.value.trim()) body.instructions = this.instructions.value;
    var numbers = this.numbers;
    Object.keys(numbers).forEach(function (name) {
      var raw = numbers[name].value.trim();
      if (raw !== "") body[name] = name === "max_output_tokens" ? parseInt(raw, 10) : parseFloat(raw);
    });
    if (this.previousId) body.previous_response_id = this.previousId;
    return body;
  };

  Playground.prototype.create = function () {
    var text = this.input.value;
    if (this.turn || !this.form.reportValidity() || !text.trim()) return;
    var el = this.lib.el;
    var answer = el("div", { className: "pg-text" });
    var item = el("li", { className: "pg-assistant pg-pending" }, [el("div", { className: "pg-role", text: "assistant" }), answer]);
    this.transcript.append(
      el("li", { className: "pg-user" }, [el("div", { className: "pg-role", text: "you" }), el("div", { className: "pg-text", text: text })]),
      item
    );
    this.turn = { text: text, item: item, answer: answer, t0: performance.now(), tFirst: null, deltas: 0, responseId: null };
    this.hideError();
    this.stats({ status: "sending", ttft: DASH, tps: DASH, cache: DASH, cached: DASH, tokens: DASH, id: DASH });
    if (!this.socket.send(this.body(text))) {
      this.endTurn("failed", "Not connected to /ws/v1/responses; wait for it to reconnect and send again.");
      return;
    }
    this.input.value = "";
    this.buttons();
  };

  Playground.prototype.cancelTurn = function () {
    if (!this.turn) return;
    var frame = { type: "response.cancel" };
    if (this.turn.responseId) frame.response_id = this.turn.responseId;
    this.socket.send(frame);
    this.turn.cancelling = true;
    this.stats({ status: "cancelling\u2026" });
    this.buttons();
  };

  Playground.prototype.newConversation = function (label) {
    if (this.turn) return;
    this.previousId = null;
    this.transcript.replaceChildren();
    this.conversation.textContent = label;
    this.hideError();
    this.stats({ status: DASH, ttft: DASH, tps: DASH, cache: DASH, cached: DASH, tokens: DASH, id: DASH });
  };

  // Frames --------------------------------------------------------------------------------------

  Playground.prototype.onFrame = function (frame) {
    var turn = this.turn;
    if (frame.type === "error") {
      this.showError(frame);
      if (turn && (!frame.response_id || !turn.responseId || frame.response_id === turn.responseId)) {
        this.endTurn("failed", null);
      }
      return;
    }
    if (!turn) return;
    switch (frame.type) {
      case "response.queued":
        turn.responseId = frame.response_id;
        this.queue.textContent = "Queued: position " + frame.position + " in the model's lane";
        this.queue.hidden = false;
        this.stats({ status: "queued", id: frame.response_id });
        break;
      case "response.created":
        turn.responseId = frame.response.id;
        this.queue.hidden = true;
        this.stats({ status: frame.response.status, id: frame.response.id, cache: frame.session_cache || DASH });
        break;
      case "response.in_progress":
        this.stats({ status: "in_progress" });
        break;
      case "response.output_text.delta":
        this.delta(turn, frame.delta);
        break;
      case "response.completed":
      case "response.incomplete":
      case "response.failed":
        this.finish(turn, frame.response);
        break;
      default:
        break;
    }
  };

  Playground.prototype.delta = function (turn, text) {
    var now = performance.now();
    if (turn.tFirst === null) {
      turn.tFirst = now;
      turn.item.classList.remove("pg-pending");
      turn.item.classList.add("pg-streaming");
      this.stats({ ttft: Math.round(now - turn.t0) + " ms" });
    }
    turn.deltas += 1;
    turn.answer.append(document.createTextNode(text));
    var seconds = (now - turn.tFirst) / 1000;
    if (seconds > 0.2) this.stats({ tps: "\u2248 " + this.lib.formatNumber((turn.deltas - 1) / seconds) + " (deltas/s)" });
  };

  Playground.prototype.finish = function (turn, response) {
    var usage = response.usage || null;
    var seconds = turn.tFirst === null ? 0 : (performance.now() - turn.tFirst) / 1000;
    var update = { status: response.status + (response.incomplete_details ? " (" + response.incomplete_details.reason + ")" : ""), id: response.id };
    if (usage) {
      var details = usage.input_tokens_details || {};
      update.cached = String(details.cached_tokens || 0) + " of " + usage.input_tokens;
      update.tokens = usage.input_tokens + " / " + usage.output_tokens;
      // Decode rate: the tokens after the first, over the time after the first delta.
      update.tps = usage.output_tokens > 1 && seconds > 0 ? this.lib.formatNumber((usage.output_tokens - 1) / seconds) : DASH;
    }
    this.stats(update);
    if (response.status === "failed" && response.error) {
      this.showError({ status: "", error: { message: response.error.message, code: response.error.code, type: "generation_failed" } });
    }
    if (CONTINUABLE[response.status]) {
      this.previousId = response.id;
      this.conversation.textContent = "continues " + response.id;
    }
    this.endTurn(response.status, null);
  };

  Playground.prototype.endTurn = function (status, message) {
    var turn = this.turn;
    if (!turn) return;
    this.turn = null;
    turn.item.classList.remove("pg-pending", "pg-streaming");
    turn.item.classList.add("pg-" + status);
    turn.item.dataset.status = status;
    if (status === "failed" && turn.tFirst === null && !this.input.value) this.input.value = turn.text; // try again
    if (message) this.showError({ status: "", error: { message: message, type: "client_error" } });
    this.queue.hidden = true;
    this.buttons();
  };

  // Display -------------------------------------------------------------------------------------

  Playground.prototype.showError = function (frame) {
    var err = frame.error || {};
    var head = [frame.status, err.type, err.code ? "(" + err.code + ")" : ""].filter(Boolean).join(" ");
    var el = this.lib.el;
    this.error.replaceChildren(
      el("strong", { text: head || "error" }),
      " " + (err.message || "Unknown error."),
      err.param ? el("span", { className: "quiet", text: " [param: " + err.param + "]" }) : "",
      frame.retry_after ? el("span", { text: " Retry after " + frame.retry_after + " s." }) : ""
    );
    this.error.hidden = false;
  };

  Playground.prototype.hideError = function () {
    this.error.hidden = true;
    this.error.replaceChildren();
  };

  Playground.prototype.stats = function (values) {
    Object.keys(values).forEach(function (name) {
      var node = document.querySelector('#pg-stats [data-stat="' + name + '"]');
      if (node) node.textContent = values[name];
    });
  };

  Playground.prototype.defaults = function () {
    var option = this.model.selectedOptions[0];
    if (!option) return;
    this.numbers.temperature.placeholder = option.dataset.temperature || "";
    this.numbers.top_p.placeholder = option.dataset.topP || "";
    this.numbers.max_output_tokens.placeholder = option.dataset.maxOutputTokens || "";
  };

  Playground.prototype.buttons = function () {
    var running = this.turn !== null;
    this.send.disabled = running || !this.socket.isOpen() || !this.model.value;
    this.cancel.disabled = !running || Boolean(this.turn && this.turn.cancelling);
    this.reset.disabled = running;
    this.root.dataset.running = running ? "true" : "false";
  };

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("playground");
    if (root && window.mlxhost) new Playground(root, window.mlxhost).start();
  });
})();
