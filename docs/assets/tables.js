// A table wider than its column gets a line above it that says so and names the columns out of view
// (the table scrolls sideways; its first column stays put, see tables.css). Redone on resize.
function paceScrollHints() {
  document.querySelectorAll("article table").forEach((table) => {
    const wrap = table.closest(".md-typeset__scrollwrap") || table.parentElement;
    const previous = wrap.previousElementSibling;
    if (previous && previous.classList.contains("pace-scroll-hint")) previous.remove();
    if (!table.rows.length || table.scrollWidth <= wrap.clientWidth + 1) return;
    const edge = wrap.getBoundingClientRect().right + 1;
    const hidden = Array.from(table.rows[0].cells)
      .filter((cell) => cell.getBoundingClientRect().right > edge)
      .map((cell) => cell.innerText.trim());
    const hint = document.createElement("p");
    hint.className = "pace-scroll-hint";
    hint.textContent = "Wider than the page: scroll the table sideways (\u2192) for "
      + (hidden.length === 1 ? "the column " : hidden.length + " more columns: ") + hidden.join(", ");
    wrap.before(hint);
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(paceScrollHints);  // Material's page-load signal, after it wrapped the tables
} else {
  window.addEventListener("load", paceScrollHints);
}
window.addEventListener("resize", paceScrollHints);
