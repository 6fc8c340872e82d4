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

  function tick() {
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
  schedule();
})();
