// A text field with a list of matches under it (the WAI-ARIA combobox pattern). The
// server fills the list (htmx); this makes it usable from the keyboard: the arrow
// keys move through the matches, Enter puts the chosen one in the field, Escape
// closes the list. The field holds what is submitted, so typing a full username or
// VM name and pressing Enter works without the list, and the server checks it. A list
// that arrives after a match was chosen (its search was still on its way) does not
// open again over the choice: only typing does.
(function () {
  "use strict";

  function listFor(input) {
    return document.getElementById(input.getAttribute("aria-controls"));
  }

  function choices(list) {
    return Array.from(list.querySelectorAll('[role="option"]:not([aria-disabled="true"])'));
  }

  function setOpen(input, list, open) {
    list.hidden = !open;
    input.setAttribute("aria-expanded", open ? "true" : "false");
    if (!open) input.removeAttribute("aria-activedescendant");
  }

  function highlight(input, list, option) {
    list.querySelectorAll('[aria-selected="true"]').forEach(function (o) {
      o.setAttribute("aria-selected", "false");
    });
    option.setAttribute("aria-selected", "true");
    input.setAttribute("aria-activedescendant", option.id);
    option.scrollIntoView({ block: "nearest" });
  }

  function choose(input, list, option) {
    input.value = option.dataset.value;
    input.dataset.chosen = input.value;
    // A search still on its way is for what was typed before the choice.
    if (window.htmx) window.htmx.trigger(input, "htmx:abort");
    setOpen(input, list, false);
    input.focus();
  }

  document.addEventListener("input", function (event) {
    var input = event.target;
    if (input.matches && input.matches('input[role="combobox"]')) delete input.dataset.chosen;
  });

  document.addEventListener("keydown", function (event) {
    var input = event.target;
    if (!input.matches || !input.matches('input[role="combobox"]')) return;
    var list = listFor(input);
    if (!list) return;
    var options = choices(list);
    var current = document.getElementById(input.getAttribute("aria-activedescendant") || "");
    var at = options.indexOf(current);
    if (event.key === "ArrowDown" || event.key === "ArrowUp") {
      if (!options.length) return;
      event.preventDefault();
      setOpen(input, list, true);
      var step = event.key === "ArrowDown" ? 1 : -1;
      highlight(input, list, options[(at + step + options.length) % options.length]);
    } else if (event.key === "Enter" && !list.hidden && current && at >= 0) {
      event.preventDefault(); // choose; a second Enter submits the form
      choose(input, list, current);
    } else if (event.key === "Escape" && !list.hidden) {
      event.preventDefault();
      setOpen(input, list, false);
    }
  });

  document.addEventListener("click", function (event) {
    var option = event.target.closest && event.target.closest('[role="option"]');
    if (!option || option.getAttribute("aria-disabled") === "true") return;
    var input = document.querySelector('input[aria-controls="' + option.parentElement.id + '"]');
    if (input) choose(input, option.parentElement, option);
  });

  // A fresh list from the server: open it if it has anything, nothing highlighted.
  document.addEventListener("htmx:afterSwap", function (event) {
    var list = event.detail.target;
    if (!list || list.getAttribute("role") !== "listbox") return;
    var input = document.querySelector('input[aria-controls="' + list.id + '"]');
    if (!input) return;
    var chosen = input.dataset.chosen === input.value;
    setOpen(
      input,
      list,
      !chosen && list.children.length > 0 && document.activeElement === input
    );
  });
})();
