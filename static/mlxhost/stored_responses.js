/* mlxhost stored responses list (ADM-5): each answer's preview rendered as Markdown by
 * markdown.js (DOM nodes only: markup in model output never runs, under the strict CSP). */
(function () {
  "use strict";

  document.addEventListener("DOMContentLoaded", function () {
    if (!window.mlxhostMarkdown) return;
    document.querySelectorAll("[data-markdown]").forEach(function (node) {
      node.replaceChildren(window.mlxhostMarkdown.render(node.textContent));
      node.removeAttribute("data-markdown");
    });
  });
})();
