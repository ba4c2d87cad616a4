/* The dashboard's small behaviours: copy buttons, code tabs, the mobile menu, confirmations. */
(function () {
  "use strict";

  function copyText(text, button) {
    const done = () => {
      if (!button) return;
      const label = button.querySelector("[data-label]") || button;
      const before = label.textContent;
      button.classList.add("copied");
      label.textContent = "Copied";
      setTimeout(() => { button.classList.remove("copied"); label.textContent = before; }, 1600);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text) && done());
    } else if (fallbackCopy(text)) {
      done();
    }
  }

  function fallbackCopy(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    area.remove();
    return ok;
  }

  // The mobile menu (an off-canvas sidebar): its button says whether it is open; Escape closes it.
  function setNav(open, { returnFocus = false } = {}) {
    const toggle = document.querySelector("[data-nav-toggle]");
    document.body.classList.toggle("nav-open", open);
    if (toggle) toggle.setAttribute("aria-expanded", String(open));
    if (open) document.querySelector(".sidebar a, .sidebar button, .sidebar summary")?.focus();
    else if (returnFocus && toggle) toggle.focus();
  }

  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && document.body.classList.contains("nav-open")) setNav(false, { returnFocus: true });
  });

  document.addEventListener("click", (event) => {
    const copy = event.target.closest("[data-copy]");
    if (copy) {
      event.preventDefault();
      const source = copy.getAttribute("data-copy");
      const target = source && source !== "text" ? document.querySelector(source) : null;
      copyText(target ? target.textContent : copy.getAttribute("data-copy-text") || "", copy);
      return;
    }
    const tab = event.target.closest(".code-tabs button.tab");
    if (tab) {
      const box = tab.closest(".code-tabs");
      box.querySelectorAll("button.tab").forEach((b) => b.setAttribute("aria-selected", String(b === tab)));
      box.querySelectorAll("pre[data-panel]").forEach((p) => { p.hidden = p.dataset.panel !== tab.dataset.tab; });
      const copyButton = box.querySelector(".copy-btn");
      if (copyButton) copyButton.setAttribute("data-copy", `#${box.id} pre[data-panel="${tab.dataset.tab}"]`);
      return;
    }
    if (event.target.closest("[data-nav-toggle]")) {
      setNav(!document.body.classList.contains("nav-open"));
      return;
    }
    if (document.body.classList.contains("nav-open") && !event.target.closest(".sidebar")) {
      setNav(false);
    }
    document.querySelectorAll("details[data-dropdown][open]").forEach((d) => {
      if (!d.contains(event.target)) d.removeAttribute("open");
    });
  });

  // <form data-confirm="Are you sure?">, or a chosen <option data-confirm="...">: ask first.
  document.addEventListener("submit", (event) => {
    const asking = event.target.closest("form[data-confirm]") || event.target.querySelector("option:checked[data-confirm]");
    if (asking && !window.confirm(asking.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  }, true);

  // Dialogs: <button data-open-dialog="#id"> and <button data-close-dialog>.
  document.addEventListener("click", (event) => {
    const opener = event.target.closest("[data-open-dialog]");
    if (opener) {
      const dialog = document.querySelector(opener.getAttribute("data-open-dialog"));
      if (dialog && dialog.showModal) { event.preventDefault(); dialog.showModal(); }
    }
    const closer = event.target.closest("[data-close-dialog]");
    if (closer) {
      const dialog = closer.closest("dialog");
      if (dialog) { event.preventDefault(); dialog.close(); }
    }
  });
})();
