/* mlxhost chat page (ADM-4, API-3): a conversation with an enabled alias over /ws/v1/responses.
 *
 * The server holds the history: every turn names the last one by previous_response_id, and the
 * page's address carries the newest id (?response=...), so a reload reopens the conversation from
 * the stored rows. Replies are rendered by markdown.js (DOM nodes only). Each reply shows the
 * server's figures for its turn (the socket's terminal frame carries `timings`) and says in words
 * when it was stopped or cut off. Uses the reconnecting socket of dashboard.js (window.mlxhost).
 */
(function () {
  "use strict";

  var DASH = "\u2014"; // an em dash: no value
  var CONTINUABLE = { completed: true, incomplete: true, cancelled: true };
  var SHORT_ID_CHARS = 8; // as models_app/console/words.py: resp_01234567…

  function shortId(id) {
    var cut = id.indexOf("_") + 1;
    return id.length - cut <= SHORT_ID_CHARS ? id : id.slice(0, cut + SHORT_ID_CHARS) + "\u2026";
  }
  var STATUS_WORDS = {
    cancelled: "Stopped",
    max_output_tokens: "Cut off at the token limit",
    draining: "Cut short: the model was unloaded or the server stopped",
    incomplete: "Incomplete",
    failed: "Failed",
  };
  var COPIED_MS = 1500;
  var ALIASES_EVERY_MS = 5000; // the model list is re-read this often (and when the tab shows again)
  // What a failed turn says, by the error's code: words for a person; the code itself goes below.
  var ERROR_WORDS = {
    model_not_found: "{model} is not offered for chat any more (it was disabled or removed). Pick another model and send again.",
    wrong_model_kind: "{model} is not a chat model. Pick another model and send again.",
    queue_full: "The model is busy: its queue is full.",
    queue_timeout: "The model was busy for too long: the request waited in its queue and gave up.",
    rate_limit_exceeded: "You reached a usage limit.",
    draining: "The model is being unloaded or the server is restarting.",
    engine_closed: "The server is restarting.",
    model_load_failed: "The model could not be loaded; staff can see why on the Models page.",
    context_length_exceeded: "The conversation is too long for this model. Start a new chat, or shorten the message.",
    storage_timeout: "The server could not reach the stored conversation in time.",
    too_many_turns: "Too many requests on this connection at once: wait for the reply, then send again.",
  };

  function Chat(root, lib, markdown) {
    this.lib = lib;
    this.markdown = markdown;
    this.root = root;
    this.form = document.getElementById("chat-form");
    this.model = document.getElementById("chat-model");
    this.input = document.getElementById("chat-input");
    this.send = document.getElementById("chat-send");
    this.stop = document.getElementById("chat-stop");
    this.reset = document.getElementById("chat-new");
    this.transcript = document.getElementById("chat-transcript");
    this.conversation = document.getElementById("chat-conversation");
    this.instructions = document.getElementById("chat-instructions");
    this.numbers = {
      temperature: document.getElementById("chat-temperature"),
      top_p: document.getElementById("chat-top-p"),
      max_output_tokens: document.getElementById("chat-max-output-tokens"),
    };
    this.definitions = {};
    var self = this;
    document.querySelectorAll("#chat-legend [data-figure]").forEach(function (node) {
      self.definitions[node.dataset.figure] = node.querySelector("dd").textContent;
    });
    this.modelNote = document.getElementById("chat-model-note");
    this.turns = []; // every turn shown, oldest first; the running one is `this.current`
    this.current = null;
  }

  Chat.prototype.start = function () {
    var self = this;
    var stateNode = document.getElementById("chat-socket");
    this.socket = new this.lib.LiveSocket(this.root.dataset.wsPath, {
      onMessage: function (frame) {
        self.onFrame(frame);
      },
      onState: function (name, text) {
        self.lib.showState(stateNode, name, text);
        self.buttons();
      },
      onClose: function (event) {
        var why = event.code === 4401 ? "Your session ended; the server stopped this reply." : "The connection dropped; the server cancelled this reply.";
        if (self.current) self.fail(self.current, why);
      },
    });
    this.form.addEventListener("submit", function (event) {
      event.preventDefault();
      self.submit();
    });
    this.input.addEventListener("keydown", function (event) {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        self.submit();
      }
    });
    this.stop.addEventListener("click", function () {
      self.cancel();
    });
    this.reset.addEventListener("click", function () {
      self.newConversation();
    });
    this.model.addEventListener("change", function () {
      self.defaults();
      self.buttons();
    });
    this.restore(JSON.parse(document.getElementById("chat-history").textContent));
    this.defaults();
    this.socket.connect();
    this.buttons();
    setInterval(function () {
      self.refreshAliases();
    }, ALIASES_EVERY_MS);
    document.addEventListener("visibilitychange", function () {
      if (document.visibilityState === "visible") self.refreshAliases();
    });
  };

  // The model list stays live: chat aliases only, re-read from the server, so an alias disabled
  // (or a model removed) since the page loaded leaves it, and a new one joins it.
  Chat.prototype.refreshAliases = function () {
    var self = this;
    if (this.lib.sessionEnded() || this.refreshing) return;
    this.refreshing = true;
    fetch(this.root.dataset.aliasesUrl, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (response) {
        if (response.status === 401) {
          self.lib.endSession();
          return null;
        }
        return response.ok ? response.json() : null;
      })
      .then(function (data) {
        if (data && !self.current) self.showAliases(data.aliases);
      })
      .catch(function () {}) // offline for a moment: the next round tries again
      .then(function () {
        self.refreshing = false;
      });
  };

  Chat.prototype.showAliases = function (aliases) {
    var el = this.lib.el;
    var before = this.model.value;
    var names = aliases.map(function (alias) {
      return alias.name;
    });
    var options = aliases.map(function (alias) {
      return el("option", {
        value: alias.name,
        "data-temperature": String(alias.temperature),
        "data-top-p": String(alias.top_p),
        "data-max-output-tokens": String(alias.max_output_tokens),
        text: alias.name,
      });
    });
    if (!options.length) options = [el("option", { value: "", disabled: "", text: "no chat model enabled" })];
    this.model.replaceChildren.apply(this.model, options);
    if (names.indexOf(before) !== -1) this.model.value = before;
    else if (before) this.noteModel(before + " is not offered any more (it was disabled or removed)." + (names.length ? " Now: " + this.model.value + "." : ""));
    this.defaults();
    this.buttons();
  };

  Chat.prototype.noteModel = function (text) {
    this.modelNote.textContent = text;
    this.modelNote.hidden = !text;
  };

  // The conversation the server holds -------------------------------------------------------------

  Chat.prototype.restore = function (history) {
    if (!history) return;
    var self = this;
    this.rootId = history.root;
    this.openedOn = history.id; // the stored reply this page was opened to continue
    if (history.alias && this.model.querySelector('option[value="' + CSS.escape(history.alias) + '"]')) {
      this.model.value = history.alias;
    }
    history.earlier.forEach(function (message) {
      self.transcript.append(self.earlierNode(message));
    });
    history.turns.forEach(function (row) {
      var turn = self.addTurn(row.input, row.previous_id);
      turn.id = row.id;
      turn.text = row.output;
      turn.usage = { input: row.usage.input, cached: row.usage.cached, output: row.usage.output };
      turn.timings = row.timings || null; // kept with the row: the figures survive a reload
      turn.cache = row.cache || null; // as the live frame's session_cache said it: one rendering
      self.paint(turn);
      self.settle(turn, row.status, null, row.status === "completed" ? null : row.status_text); // the server's words
    });
    this.showConversation();
  };

  Chat.prototype.tipId = function () {
    for (var i = this.turns.length - 1; i >= 0; i -= 1) {
      if (this.turns[i].id && CONTINUABLE[this.turns[i].status]) return this.turns[i].id;
    }
    return null;
  };

  Chat.prototype.showConversation = function () {
    var tip = this.tipId();
    // The stored reply this conversation continues, by a short id (the full one in its title):
    // only one it was opened on (?response=), stored before this page; a reply received here is
    // this conversation's own, so a new chat stays "New conversation" after its first turn.
    var earlier = this.openedOn || null;
    this.conversation.textContent = earlier ? "Continues a previous reply " : "New conversation";
    if (earlier) {
      var stored = this.root.dataset.storedUrl + "?q=" + encodeURIComponent(earlier);
      this.conversation.appendChild(this.lib.el("a", { className: "mono chat-tip", href: stored, title: earlier, text: shortId(earlier) }));
    }
    if (tip) {
      this.conversation.dataset.response = tip;
    } else {
      delete this.conversation.dataset.response;
    }
    var url = this.root.dataset.chatUrl + (tip ? "?response=" + encodeURIComponent(tip) : "");
    history.replaceState(null, "", url); // a reload reopens the conversation from the server
  };

  Chat.prototype.newConversation = function () {
    if (this.current) return;
    this.turns = [];
    this.rootId = null; // the next turn starts a conversation of its own
    this.openedOn = null;
    this.transcript.replaceChildren();
    var missing = document.getElementById("chat-missing");
    if (missing) missing.remove();
    this.showConversation();
    this.input.focus();
  };

  // Sending, stopping, regenerating ---------------------------------------------------------------

  Chat.prototype.submit = function () {
    var text = this.input.value;
    if (this.current || !text.trim() || this.send.disabled) return;
    if (this.run(text, this.tipId())) this.input.value = "";
  };

  Chat.prototype.body = function (text, previousId) {
    var body = { type: "response.create", model: this.model.value, input: text };
    if (this.instructions.value.trim()) body.instructions = this.instructions.value;
    var numbers = this.numbers;
    Object.keys(numbers).forEach(function (name) {
      var raw = numbers[name].value.trim();
      if (raw !== "") body[name] = name === "max_output_tokens" ? parseInt(raw, 10) : parseFloat(raw);
    });
    if (previousId) body.previous_response_id = previousId;
    return body;
  };

  Chat.prototype.run = function (text, previousId) {
    var turn = this.addTurn(text, previousId);
    turn.sentAt = performance.now();
    this.current = turn;
    turn.node.dataset.status = "pending";
    this.setStatus(turn, "Waiting for the model\u2026");
    this.buttons();
    this.scrollDown(true);
    if (!this.socket.send(this.body(text, previousId))) {
      this.fail(turn, "Not connected to the server; wait for the connection to come back and send again.");
      return false;
    }
    return true;
  };

  Chat.prototype.cancel = function () {
    var turn = this.current;
    if (!turn || turn.cancelling) return;
    var frame = { type: "response.cancel" };
    if (turn.id) frame.response_id = turn.id;
    this.socket.send(frame);
    turn.cancelling = true;
    this.setStatus(turn, "Stopping\u2026");
    this.buttons();
  };

  Chat.prototype.regenerate = function (turn) {
    if (this.current || turn !== this.turns[this.turns.length - 1]) return;
    this.turns.pop();
    turn.node.remove();
    this.run(turn.input, turn.previousId); // the same input, on the same parent: a new branch
  };

  // Frames ----------------------------------------------------------------------------------------

  Chat.prototype.onFrame = function (frame) {
    var turn = this.current;
    if (!turn) return;
    if (frame.type === "error") {
      if (!frame.response_id || !turn.id || frame.response_id === turn.id) {
        this.fail(turn, errorText(frame, turn.model), errorCode(frame));
        var code = (frame.error || {}).code;
        if (code === "model_not_found" || code === "wrong_model_kind") this.refreshAliases();
      }
      return;
    }
    switch (frame.type) {
      case "response.queued":
        turn.id = frame.response_id;
        this.setStatus(turn, "Queued: position " + frame.position + " in the model's lane");
        break;
      case "response.created":
        turn.id = frame.response.id;
        turn.cache = frame.session_cache || null;
        turn.node.dataset.responseId = turn.id;
        if (!turn.cancelling) this.setStatus(turn, "Writing\u2026");
        break;
      case "response.output_text.delta":
        this.delta(turn, frame.delta);
        break;
      case "response.completed":
      case "response.incomplete":
      case "response.failed":
        this.finish(turn, frame);
        break;
      default:
        break;
    }
  };

  Chat.prototype.delta = function (turn, text) {
    var now = performance.now();
    if (turn.firstAt === null) {
      turn.firstAt = now;
      turn.node.dataset.status = "streaming";
    }
    turn.deltas += 1;
    turn.text += text;
    var seconds = (now - turn.firstAt) / 1000;
    if (seconds > 0.2) turn.liveTps = (turn.deltas - 1) / seconds;
    this.schedulePaint(turn);
  };

  Chat.prototype.finish = function (turn, frame) {
    var response = frame.response;
    var usage = response.usage;
    if (usage) {
      turn.usage = {
        input: usage.input_tokens,
        cached: (usage.input_tokens_details || {}).cached_tokens || 0,
        output: usage.output_tokens,
      };
    }
    turn.timings = frame.timings || null;
    turn.id = response.id;
    this.paint(turn);
    var reason = response.incomplete_details ? response.incomplete_details.reason : null;
    var words = null;
    if (response.status === "failed") words = "Failed: " + ((response.error || {}).message || "the model stopped");
    this.settle(turn, response.status, reason, words);
    this.current = null;
    if (CONTINUABLE[response.status]) this.showInSidebar(turn);
    this.showConversation();
    this.buttons();
  };

  Chat.prototype.fail = function (turn, message, code) {
    if (this.current === turn) this.current = null;
    this.paint(turn);
    this.settle(turn, "failed", null, message);
    turn.errorCode.textContent = code || "";
    turn.errorCode.hidden = !code;
    if (turn.firstAt === null && !this.input.value) this.input.value = turn.input; // to send again
    this.buttons();
  };

  // Display ---------------------------------------------------------------------------------------

  Chat.prototype.addTurn = function (input, previousId) {
    var el = this.lib.el;
    var self = this;
    var turn = {
      model: this.model.value,
      input: input,
      previousId: previousId || null,
      id: null,
      text: "",
      status: null,
      usage: null,
      timings: null,
      cache: null,
      firstAt: null,
      deltas: 0,
      liveTps: null,
      painting: false,
    };
    turn.answer = el("div", { className: "chat-md" });
    turn.statusLine = el("p", { className: "chat-status", role: "status" });
    turn.errorCode = el("p", { className: "chat-error-code quiet", hidden: "" });
    turn.figures = el("dl", { className: "chat-figures" });
    turn.copy = el("button", { type: "button", className: "chat-copy", text: "Copy" });
    turn.regen = el("button", { type: "button", className: "chat-regen", text: "Regenerate" });
    turn.copy.addEventListener("click", function () {
      self.copy(turn);
    });
    turn.regen.addEventListener("click", function () {
      self.regenerate(turn);
    });
    var you = el("div", { className: "chat-msg chat-user" }, [
      el("div", { className: "chat-role", text: "You" }),
      el("div", { className: "chat-text", text: input }),
    ]);
    var reply = el("div", { className: "chat-msg chat-assistant" }, [
      el("div", { className: "chat-role", text: this.model.value || "assistant" }),
      turn.answer,
      turn.statusLine,
      turn.errorCode,
      turn.figures,
      el("div", { className: "chat-actions" }, [turn.copy, turn.regen]),
    ]);
    turn.node = el("li", { className: "chat-turn" }, [you, reply]);
    this.transcript.append(turn.node);
    this.turns.push(turn);
    return turn;
  };

  Chat.prototype.earlierNode = function (message) {
    var el = this.lib.el;
    var body = message.role === "assistant" ? el("div", { className: "chat-md" }) : el("div", { className: "chat-text", text: message.text });
    if (message.role === "assistant") body.append(this.markdown.render(message.text));
    return el("li", { className: "chat-earlier chat-role-" + message.role }, [
      el("div", { className: "chat-role", text: message.label + " (earlier, no longer stored as its own turn)" }),
      body,
    ]);
  };

  Chat.prototype.schedulePaint = function (turn) {
    var self = this;
    if (turn.painting) return;
    turn.painting = true;
    requestAnimationFrame(function () {
      turn.painting = false;
      self.paint(turn);
      self.figures(turn);
    });
  };

  Chat.prototype.paint = function (turn) {
    var near = this.nearBottom();
    turn.answer.replaceChildren(this.markdown.render(turn.text));
    this.codeButtons(turn.answer);
    turn.answer.classList.toggle("chat-blank", turn.text !== "" && !turn.text.trim()); // says so, in CSS
    this.scrollDown(near);
  };

  // Each code block gets a copy button of its own (its text as written, not the whole reply).
  Chat.prototype.codeButtons = function (root) {
    var el = this.lib.el;
    root.querySelectorAll("pre").forEach(function (pre) {
      var button = el("button", { type: "button", className: "button chat-code-copy", text: "Copy code" });
      button.addEventListener("click", function () {
        var done = function (ok) {
          button.textContent = ok ? "Copied" : "Copy failed";
          setTimeout(function () {
            button.textContent = "Copy code";
          }, COPIED_MS);
        };
        if (!navigator.clipboard || !navigator.clipboard.writeText) return done(false);
        navigator.clipboard.writeText(pre.textContent).then(
          function () {
            done(true);
          },
          function () {
            done(false);
          }
        );
      });
      var box = el("div", { className: "chat-code" });
      pre.replaceWith(box);
      box.append(button, pre);
    });
  };

  // The sidebar follows the conversation: one entry per conversation (by its first turn), moved
  // to the top and pointed at the newest turn when a turn ends.
  Chat.prototype.showInSidebar = function (turn) {
    var el = this.lib.el;
    var list = document.getElementById("chat-recent");
    if (!list || !turn.id) return;
    if (!this.rootId) this.rootId = turn.id;
    var item = list.querySelector('li[data-root="' + CSS.escape(this.rootId) + '"]');
    var first = this.turns[0];
    if (!item) {
      var label = (first ? first.input : turn.input).replace(/\s+/g, " ").trim();
      if (label.length > 60) label = label.slice(0, 59).trim() + "\u2026";
      item = el("li", { "data-root": this.rootId }, [el("a", { text: label || "Chat with " + turn.model }), " ", el("span", { className: "quiet chat-recent-meta" })]);
    }
    item.querySelector("a").setAttribute("href", "?response=" + encodeURIComponent(turn.id));
    var count = this.turns.filter(function (t) {
      return t.id && CONTINUABLE[t.status];
    }).length;
    item.querySelector(".chat-recent-meta").textContent = turn.model + " \u00b7 " + count + (count === 1 ? " turn" : " turns") + " \u00b7 just now";
    list.querySelectorAll("li.quiet").forEach(function (node) {
      node.remove(); // "None stored yet."
    });
    list.querySelectorAll("li.chat-current").forEach(function (node) {
      node.classList.remove("chat-current");
      node.removeAttribute("aria-current");
    });
    item.classList.add("chat-current");
    item.setAttribute("aria-current", "page");
    list.prepend(item);
  };

  Chat.prototype.settle = function (turn, status, reason, words) {
    turn.status = status;
    turn.node.dataset.status = status;
    if (turn.id) turn.node.dataset.responseId = turn.id;
    if (reason) turn.node.dataset.reason = reason;
    var text = words || STATUS_WORDS[reason] || STATUS_WORDS[status] || "";
    this.setStatus(turn, text);
    turn.statusLine.hidden = !text;
    this.figures(turn);
  };

  Chat.prototype.setStatus = function (turn, text) {
    turn.statusLine.textContent = text;
    turn.statusLine.hidden = !text;
  };

  Chat.prototype.figures = function (turn) {
    var el = this.lib.el;
    var fmt = this.lib.formatNumber;
    var definitions = this.definitions;
    var t = turn.timings;
    var rows = [];
    function add(key, label, value) {
      if (value === null || value === undefined) return;
      rows.push(el("div", { title: definitions[key] || "", "data-figure": key }, [el("dt", { text: label }), el("dd", { text: value })]));
    }
    add("queue", "Queue", t ? Math.round(t.queue_ms) + " ms" : null);
    add("ttft", "First token", t ? Math.round(t.ttft_ms) + " ms" : null);
    if (t && turn.usage && turn.usage.output > 1) add("tps", "Tokens/s", fmt(t.decode_tps));
    else if (!turn.status && turn.liveTps !== null) add("tps", "Tokens/s", "\u2248 " + fmt(turn.liveTps));
    if (turn.cache || turn.usage) {
      var cached = turn.usage ? turn.usage.cached + " of " + turn.usage.input + " cached" : "";
      add("cache", "Cache", [turn.cache, cached].filter(Boolean).join(" \u00b7 ") || DASH);
    }
    if (t && t.tokens_per_pass) {
      var share = t.drafted_tokens ? Math.round((100 * t.accepted_tokens) / t.drafted_tokens) + "% of " + t.drafted_tokens + " accepted" : "none drafted";
      add("drafts", "Drafts", share + " \u00b7 " + fmt(t.tokens_per_pass, 2) + " per pass");
    }
    if (turn.usage) add("tokens", "Tokens", turn.usage.input + " in / " + turn.usage.output + " out");
    turn.figures.replaceChildren.apply(turn.figures, rows);
  };

  Chat.prototype.copy = function (turn) {
    var button = turn.copy;
    function done(ok) {
      button.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(function () {
        button.textContent = "Copy";
      }, COPIED_MS);
    }
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(turn.text).then(
        function () {
          done(true);
        },
        function () {
          done(false);
        }
      );
    } else {
      done(false); // no clipboard outside a secure context (plain http to another host)
    }
  };

  Chat.prototype.nearBottom = function () {
    var page = document.scrollingElement || document.documentElement;
    return page.scrollHeight - page.scrollTop - page.clientHeight < 80;
  };

  Chat.prototype.scrollDown = function (wanted) {
    if (!wanted) return;
    var page = document.scrollingElement || document.documentElement;
    page.scrollTop = page.scrollHeight;
  };

  Chat.prototype.defaults = function () {
    var option = this.model.selectedOptions[0];
    if (!option) return;
    this.numbers.temperature.placeholder = option.dataset.temperature || "";
    this.numbers.top_p.placeholder = option.dataset.topP || "";
    this.numbers.max_output_tokens.placeholder = option.dataset.maxOutputTokens || "";
  };

  Chat.prototype.buttons = function () {
    var running = this.current !== null;
    var last = this.turns[this.turns.length - 1];
    if (this.lib.sessionEnded()) {
      this.lib.disableControls();
      this.turns.forEach(function (turn) {
        turn.regen.hidden = true;
      });
      return;
    }
    this.send.disabled = running || !this.socket.isOpen() || !this.model.value;
    this.stop.disabled = !running || Boolean(this.current && this.current.cancelling);
    this.reset.disabled = running;
    this.model.disabled = running;
    this.turns.forEach(function (turn) {
      var empty = turn.text === "" && turn !== this.current; // nothing to copy or to do again
      turn.regen.hidden = turn !== last || running || empty;
      turn.copy.hidden = turn === this.current || empty;
    }, this);
    this.root.dataset.running = running ? "true" : "false";
  };

  // A person's words for an error frame; the status and code go on a quiet line of their own.
  function errorText(frame, model) {
    var err = frame.error || {};
    var words = ERROR_WORDS[err.code];
    var text = words ? words.replace("{model}", model || "This model") : fallbackWords(frame.status);
    // A bad setting's message names the field and its range: that is the useful part.
    if (!words && err.code === "invalid_value" && err.message) text += " " + err.message;
    if (frame.retry_after) text += " Try again in " + frame.retry_after + " s.";
    return text;
  }

  function fallbackWords(status) {
    if (status >= 500) return "The server could not answer this time. Try again in a moment.";
    if (status === 429) return "Too many requests right now.";
    return "The server did not accept this message.";
  }

  function errorCode(frame) {
    var err = frame.error || {};
    return [frame.status, err.code || err.type].filter(Boolean).join(" \u00b7 ");
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("chat");
    if (root && window.mlxhost && window.mlxhostMarkdown) new Chat(root, window.mlxhost, window.mlxhostMarkdown).start();
  });
})();
