// The dashboard's own script. It is a file of this origin, not inline, so the pages'
// Content-Security-Policy needs no 'unsafe-inline' (controlplane/settings.py).
(function () {
  "use strict";

  // Bars and meters carry their width as data-width (percent). A style="width: ..." attribute
  // would be refused by the policy; setting it through the CSSOM is allowed. Run on the page and
  // on every fragment htmx swaps in.
  function sizeBars(root) {
    const scope = root && root.querySelectorAll ? root : document;
    const found = Array.from(scope.querySelectorAll("[data-width]"));
    if (scope.matches && scope.matches("[data-width]")) found.push(scope);
    for (const element of found) {
      const percent = Number(element.dataset.width);
      if (Number.isFinite(percent)) element.style.width = Math.min(Math.max(percent, 0), 100) + "%";
    }
  }

  // Quotas: a row's Edit (or Set) button fills the form above the table, no round trip needed.
  function editQuota(button) {
    const form = document.getElementById("quota-form");
    if (!form) return;
    form.elements.namespace.value = button.dataset.ns;
    form.elements.gpumem_mib.value = button.dataset.mem;
    form.elements.gpucores.value = button.dataset.cores;
    form.elements.gpus.value = button.dataset.gpus;
    form.elements.gpumem_mib.focus();
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest && event.target.closest("button[data-quota-edit]");
    if (button) editQuota(button);
  });

  // A filter form marked data-autosubmit applies a choice as soon as it is made; without this
  // script its submit button does the same.
  document.addEventListener("change", function (event) {
    const form = event.target.closest && event.target.closest("form[data-autosubmit]");
    if (form && event.target.matches("select")) form.requestSubmit();
  });

  if (window.htmx) {
    window.htmx.onLoad(sizeBars); // the whole page once htmx starts, then each swapped fragment
  } else {
    document.addEventListener("DOMContentLoaded", function () { sizeBars(document); });
  }
})();
