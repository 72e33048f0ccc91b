/* mlxhost: copy buttons on the page that shows a new API key once (KEY-1).
   Static file, no inline script: the admin runs under Content-Security-Policy script-src 'self'.
   A button names the element whose text it copies in data-copy; without JavaScript the buttons
   stay hidden and the text is selectable as usual. */
(function () {
  "use strict";

  function selectText(node) {
    var range = document.createRange();
    range.selectNodeContents(node);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function copyText(node) {
    var text = node.textContent;
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text);
    }
    // Plain http on a LAN address is not a secure context: fall back to a selection copy.
    selectText(node);
    var copied = document.execCommand && document.execCommand("copy");
    return copied ? Promise.resolve() : Promise.reject(new Error("copy refused"));
  }

  function announce(message) {
    var status = document.getElementById("mlxhost-copy-status");
    if (status) status.textContent = message;
  }

  // The model picker: one group of snippets per enabled alias; the chosen one shows.
  function showAlias(alias) {
    document.querySelectorAll(".mlxhost-snippet-group").forEach(function (group) {
      group.hidden = group.getAttribute("data-alias") !== alias;
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var picker = document.getElementById("mlxhost-snippet-alias");
    if (picker && picker.options.length > 1) {
      document.getElementById("mlxhost-snippet-pick").hidden = false;
      picker.addEventListener("change", function () { showAlias(picker.value); });
      showAlias(picker.value);
    }
    document.querySelectorAll("button[data-copy]").forEach(function (button) {
      var target = document.getElementById(button.getAttribute("data-copy"));
      if (!target) return;
      var label = button.textContent;
      button.hidden = false;
      button.addEventListener("click", function () {
        copyText(target).then(
          function () {
            button.textContent = "Copied";
            button.classList.add("mlxhost-copied");
            announce("Copied to the clipboard.");
            window.setTimeout(function () {
              button.textContent = label;
              button.classList.remove("mlxhost-copied");
            }, 2000);
          },
          function () {
            selectText(target);
            announce("Copying was refused by the browser: the text is selected, press Ctrl+C or ⌘C.");
          }
        );
      });
    });
  });
})();
