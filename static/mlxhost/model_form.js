/* The model form (ADM-7): a click on a suggested folder fills the folder field. */
(function () {
  "use strict";
  document.addEventListener("click", function (event) {
    var button = event.target.closest("button.mlxhost-suggestion");
    if (!button) return;
    var input = document.getElementById(button.dataset.fill);
    if (!input) return;
    input.value = button.value;
    input.dispatchEvent(new Event("change", { bubbles: true }));
    input.focus();
  });
})();
