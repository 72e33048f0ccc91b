/* mlxhost: Markdown of model replies, built as DOM nodes only (ADM-4).
 *
 * Why not vendored marked + DOMPurify: they turn text into an HTML string and then clean it, so
 * safety rests on the sanitiser agreeing with the browser's parser and on its settings staying
 * right. This renderer never parses HTML and never assigns innerHTML, outerHTML or
 * insertAdjacentHTML: reply text reaches the page only through createTextNode and textContent, so
 * markup in a reply (<script>, <img onerror=...>) shows as the literal text it is, and no sanitiser
 * is needed. Links are made for explicit http(s) and mailto URLs only; anything else stays text.
 * It covers what chat models write (paragraphs, headings, lists, quotes, fenced code, tables,
 * emphasis, code spans, links) with nothing vendored to keep patched.
 */
(function () {
  "use strict";

  var FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)/;
  var HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
  var RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  var QUOTE = /^ {0,3}> ?(.*)$/;
  var ITEM = /^( {0,3}| *)([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
  var TABLE_RULE = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
  var BLANK = /^[ \t]*$/;
  var EXPLICIT_URL = /^(https?:\/\/|mailto:)/i;
  var LINK_PROTOCOLS = { "http:": true, "https:": true, "mailto:": true };
  var MAX_DEPTH = 8; // quotes and lists nest this deep at most; deeper lines are paragraphs
  var MAX_CHARS = 200000; // past this a reply is shown as plain text: bounded work per repaint

  // The earliest of these wins at each point; the text between matches is plain.
  var INLINE = new RegExp(
    [
      "\\\\([!-/:-@[-`{-~])", // 1: a backslash escape
      "(`+)([^`]|[^`][\\s\\S]*?[^`])\\2(?!`)", // 2, 3: a code span
      "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 4: strong
      "__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)", // 5: strong
      "~~(?=\\S)([\\s\\S]*?\\S)~~", // 6: struck out
      "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*(?!\\*)", // 7: emphasis
      "(?<!\\w)_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // 8: emphasis
      '\\[([^\\]\\n]+)\\]\\([ \\t]*<?([^\\s<>()]*(?:\\([^\\s<>()]*\\)[^\\s<>()]*)*)>?(?:[ \\t]+"[^"\\n]*")?[ \\t]*\\)', // 9, 10: a link
      "<((?:https?://|mailto:)[^\\s<>]+)>", // 11: an autolink
      "(https?://[^\\s<>\"'`]*[^\\s<>\"'`.,;:!?)\\]}*_~])", // 12: a bare URL
    ].join("|"),
    "g"
  );

  function make(tag, className) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function leading(line) {
    return line.length - line.replace(/^ +/, "").length;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line);
  }

  // Inline ------------------------------------------------------------------------------------

  function plain(text, parent) {
    text.split("\n").forEach(function (piece, n) {
      if (n) parent.append(make("br"));
      if (piece) parent.append(document.createTextNode(piece));
    });
  }

  function safeUrl(raw) {
    if (!EXPLICIT_URL.test(raw)) return null; // never relative: "foo" would point into this site
    var probe = make("a");
    probe.href = raw;
    return LINK_PROTOCOLS[probe.protocol] ? probe.href : null;
  }

  function link(parent, label, target, raw, labelIsUrl, inLink) {
    var url = inLink ? null : safeUrl(target);
    if (!url) {
      plain(raw, parent); // not a link we make: the characters as written
      return;
    }
    var a = make("a");
    a.href = url;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    if (labelIsUrl) a.textContent = label;
    else inline(label, a, true);
    parent.append(a);
  }

  function inline(text, parent, inLink) {
    var re = new RegExp(INLINE.source, "g");
    var last = 0;
    var m;
    function wrap(tag, inner) {
      var node = make(tag);
      inline(inner, node, inLink);
      parent.append(node);
    }
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) plain(text.slice(last, m.index), parent);
      last = re.lastIndex;
      if (m[1] !== undefined) plain(m[1], parent);
      else if (m[2] !== undefined) {
        var code = make("code");
        var body = m[3];
        code.textContent = body.length > 2 && body[0] === " " && body[body.length - 1] === " " ? body.slice(1, -1) : body;
        parent.append(code);
      } else if (m[4] !== undefined) wrap("strong", m[4]);
      else if (m[5] !== undefined) wrap("strong", m[5]);
      else if (m[6] !== undefined) wrap("del", m[6]);
      else if (m[7] !== undefined) wrap("em", m[7]);
      else if (m[8] !== undefined) wrap("em", m[8]);
      else if (m[9] !== undefined) link(parent, m[9], m[10], m[0], false, inLink);
      else if (m[11] !== undefined) link(parent, m[11], m[11], m[0], true, inLink);
      else link(parent, m[12], m[12], m[0], true, inLink);
    }
    if (last < text.length) plain(text.slice(last), parent);
  }

  // Blocks ------------------------------------------------------------------------------------

  function codeBlock(lines, start, match, parent) {
    var fence = match[1];
    var closing = new RegExp("^ {0,3}" + (fence[0] === "`" ? "`" : "~") + "{" + fence.length + ",}[ \\t]*$");
    var body = [];
    var i = start + 1;
    while (i < lines.length && !closing.test(lines[i])) {
      body.push(lines[i]);
      i += 1;
    }
    var pre = make("pre", "md-code");
    var code = make("code");
    var lang = match[2].replace(/[^\w+#.-]/g, "");
    if (lang) code.className = "language-" + lang;
    code.textContent = body.join("\n"); // a fence still open (streaming) runs to the end
    pre.append(code);
    parent.append(pre);
    return i + 1;
  }

  function quote(lines, start, parent, depth) {
    var inner = [];
    var i = start;
    var m;
    while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
      inner.push(m[1]);
      i += 1;
    }
    var node = make("blockquote");
    blocks(inner, node, depth + 1);
    parent.append(node);
    return i;
  }

  function sameList(match, indent, ordered) {
    return match && leading(match[1]) === indent && /\d/.test(match[2]) === ordered;
  }

  function listItem(lines, start, match, depth) {
    var indent = leading(match[1]);
    var under = indent + match[2].length + 1; // where the item's text starts
    var body = [match[3]];
    var i = start + 1;
    while (i < lines.length) {
      var line = lines[i];
      if (BLANK.test(line)) {
        var j = i;
        while (j < lines.length && BLANK.test(lines[j])) j += 1;
        if (j >= lines.length || leading(lines[j]) < Math.min(under, indent + 2)) break;
        for (; i < j; i += 1) body.push("");
        continue;
      }
      if (leading(line) >= indent + 2) body.push(line.slice(Math.min(leading(line), under)));
      else if (ITEM.test(line) || startsBlock(line)) break;
      else body.push(line.trim()); // a lazy continuation of the item's paragraph
      i += 1;
    }
    var li = make("li");
    blocks(body, li, depth + 1);
    var only = li.firstChild;
    if (li.childNodes.length === 1 && only.nodeName === "P") {
      while (only.firstChild) li.append(only.firstChild); // a tight item: no paragraph margins
      only.remove();
    }
    return { node: li, next: i };
  }

  function list(lines, start, parent, depth) {
    var first = ITEM.exec(lines[start]);
    var indent = leading(first[1]);
    var ordered = /\d/.test(first[2]);
    var node = make(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    var i = start;
    var m = first;
    while (sameList(m, indent, ordered)) {
      var item = listItem(lines, i, m, depth);
      node.append(item.node);
      i = item.next;
      var k = i;
      while (k < lines.length && BLANK.test(lines[k])) k += 1;
      m = k < lines.length ? ITEM.exec(lines[k]) : null;
      if (sameList(m, indent, ordered)) i = k;
    }
    parent.append(node);
    return i;
  }

  function cells(line) {
    var text = line.trim();
    if (text[0] === "|") text = text.slice(1);
    if (text[text.length - 1] === "|" && text[text.length - 2] !== "\\") text = text.slice(0, -1);
    return text.split(/(?<!\\)\|/).map(function (cell) {
      return cell.trim().replace(/\\\|/g, "|");
    });
  }

  function isTable(lines, i) {
    return i + 1 < lines.length && lines[i].indexOf("|") !== -1 && lines[i + 1].indexOf("|") !== -1 && TABLE_RULE.test(lines[i + 1]);
  }

  function alignment(cell) {
    var left = cell[0] === ":";
    var right = cell[cell.length - 1] === ":";
    if (left && right) return "md-center";
    return right ? "md-right" : "";
  }

  function table(lines, start, parent) {
    var head = cells(lines[start]);
    var aligns = cells(lines[start + 1]).map(alignment);
    var wrapper = make("div", "md-table"); // scrolls sideways by itself: the page never does
    var node = make("table");
    var row = make("tr");
    head.forEach(function (text, n) {
      var th = make("th", aligns[n] || "");
      inline(text, th);
      row.append(th);
    });
    var thead = make("thead");
    thead.append(row);
    var tbody = make("tbody");
    var i = start + 2;
    while (i < lines.length && !BLANK.test(lines[i]) && lines[i].indexOf("|") !== -1) {
      var values = cells(lines[i]);
      var tr = make("tr");
      head.forEach(function (_h, n) {
        var td = make("td", aligns[n] || "");
        inline(values[n] || "", td);
        tr.append(td);
      });
      tbody.append(tr);
      i += 1;
    }
    node.append(thead, tbody);
    wrapper.append(node);
    parent.append(wrapper);
    return i;
  }

  function paragraph(lines, start, parent, depth) {
    var body = [lines[start].trim()];
    var i = start + 1;
    while (i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i]) && !isTable(lines, i)) {
      if (depth < MAX_DEPTH && ITEM.test(lines[i]) && leading(lines[i]) < 4) break;
      body.push(lines[i].trim());
      i += 1;
    }
    var p = make("p");
    inline(body.join("\n"), p);
    parent.append(p);
    return i;
  }

  function blocks(lines, parent, depth) {
    var i = 0;
    while (i < lines.length) {
      var line = lines[i];
      var m;
      if (BLANK.test(line)) i += 1;
      else if ((m = FENCE.exec(line))) i = codeBlock(lines, i, m, parent);
      else if ((m = HEADING.exec(line))) {
        var heading = make("h" + Math.min(6, m[1].length + 2)); // the page has h1 and h2 already
        inline(m[2], heading);
        parent.append(heading);
        i += 1;
      } else if (RULE.test(line)) {
        parent.append(make("hr"));
        i += 1;
      } else if (depth < MAX_DEPTH && QUOTE.test(line)) i = quote(lines, i, parent, depth);
      else if (depth < MAX_DEPTH && ITEM.test(line) && leading(line) < 4) i = list(lines, i, parent, depth);
      else if (isTable(lines, i)) i = table(lines, i, parent);
      else i = paragraph(lines, i, parent, depth);
    }
  }

  /** Markdown `text` as a DocumentFragment of plain DOM nodes (no HTML is ever parsed). */
  function render(text) {
    var fragment = document.createDocumentFragment();
    text = String(text === null || text === undefined ? "" : text);
    if (text.length > MAX_CHARS) {
      var pre = make("pre", "md-plain");
      pre.textContent = text;
      fragment.append(pre);
      return fragment;
    }
    blocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment, 0);
    return fragment;
  }

  window.mlxhostMarkdown = { render: render };
})();
