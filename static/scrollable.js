// A card whose table is wider than the screen scrolls sideways inside itself (see
// portal.css). Such a card is made a focusable, named region, so it can be scrolled
// with the keyboard too; one that fits is left alone.
(function () {
  function mark() {
    document.querySelectorAll(".card").forEach(function (card) {
      var scrolls = card.scrollWidth > card.clientWidth + 1;
      if (scrolls && !card.hasAttribute("tabindex")) {
        var heading = card.querySelector("h2, h3");
        card.setAttribute("tabindex", "0");
        card.setAttribute("role", "region");
        card.setAttribute("aria-label", heading ? heading.textContent.trim() : "Scrollable table");
        card.dataset.scrolls = "1";
      } else if (!scrolls && card.dataset.scrolls) {
        card.removeAttribute("tabindex");
        card.removeAttribute("role");
        card.removeAttribute("aria-label");
        delete card.dataset.scrolls;
      }
    });
  }
  document.addEventListener("DOMContentLoaded", mark);
  window.addEventListener("resize", mark);
  document.addEventListener("htmx:afterSettle", mark);
  // A table under a chart (in a <details>) may make its card wider once opened.
  document.addEventListener("toggle", mark, true);
})();
