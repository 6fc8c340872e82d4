// Keeps a run page live: poll the cheap progress endpoint and, when the journal grew,
// swap in the server-rendered header, diagram and timeline. No page reload.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var runId = live.getAttribute("data-run");
  var seq = live.getAttribute("data-seq");
  var every = 250; // ms: a commit shows within about a second
  var finished = ["succeeded", "failed", "stopped"];
  var base = "/api/runs/" + encodeURIComponent(runId);
  var busy = false;

  function refresh() {
    // The same ?seq=&from=&to= as the page: the context shown follows the user's choice.
    var url = "/runs/" + encodeURIComponent(runId) + "/live" + window.location.search;
    return fetch(url, { headers: { "Accept": "text/html" } })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
      .then(function (html) {
        live.innerHTML = html;
        countDown(); // (from now: the times to come just swapped in)
        var body = document.getElementById("live-body");
        if (body) {
          live.setAttribute("data-seq", body.getAttribute("data-seq"));
          var status = body.getAttribute("data-status");
          if (finished.indexOf(status) >= 0) {
            var dot = document.getElementById("live-indicator");
            if (dot) { dot.classList.remove("on"); dot.textContent = "finished"; }
          }
        }
      });
  }

  // A time to come, "in 59 min" (rendered from the database clock: data-now), counted
  // down here from when the page got it (data-got), so a page left open does not say it for ever.
  // The same words as the server's (flowloop/ui/app.py: _fmt_until).
  function until(left) {
    if (left <= 0) { return "due now"; }
    if (left < 60) { return "in " + Math.ceil(left) + " s"; }
    if (left < 5400) { return "in " + Math.floor(left / 60 + 0.5) + " min"; }
    if (left < 172800) { return "in " + (left / 3600).toFixed(1) + " h"; }
    return "in " + (left / 86400).toFixed(1) + " d";
  }

  function countDown() {
    var now = Date.now();
    var found = live.querySelectorAll(".until[data-at]");
    for (var i = 0; i < found.length; i++) {
      var el = found[i];
      if (!el.hasAttribute("data-got")) { el.setAttribute("data-got", String(now)); }
      var served = parseFloat(el.getAttribute("data-now"));
      var since = (now - parseFloat(el.getAttribute("data-got"))) / 1000;
      var text = until(parseFloat(el.getAttribute("data-at")) - served - since);
      if (el.textContent !== text) { el.textContent = text; }
    }
  }

  function tick() {
    countDown();
    if (busy || document.hidden) { return schedule(); }
    busy = true;
    fetch(base + "/progress", { headers: { "Accept": "application/json" } })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
      .then(function (p) {
        var typing = live.contains(document.activeElement) &&
          ["INPUT", "SELECT"].indexOf(document.activeElement.tagName) >= 0;
        if (String(p.last_seq) !== String(seq) && !typing) { // never swap away what is typed
          seq = String(p.last_seq);
          return refresh();
        }
      })
      .catch(function () { /* the server restarts or the network blinks: try again */ })
      .then(function () { busy = false; schedule(); });
  }

  function schedule() { window.setTimeout(tick, every); }
  countDown();
  schedule();
})();
