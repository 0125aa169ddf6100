/* Device page charts: reads the JSON block the server rendered and draws one uPlot chart per
   entry (time on x, one line per series). No inline script: the page's CSP forbids it. */
(function () {
  "use strict";
  var COLORS = ["#0b5ea8", "#76b900", "#b3261e", "#f39c12", "#8e44ad", "#16a085", "#7f8c8d",
                "#d35400"];
  function compact(v) {  // 115443 -> "115k": y labels fit the axis
    if (v === null) { return ""; }
    var a = Math.abs(v);
    if (a >= 1e6) { return +(v / 1e6).toFixed(2) + "M"; }
    if (a >= 1e4) { return +(v / 1e3).toFixed(1) + "k"; }
    return String(+v.toFixed(4));
  }
  function draw(root, chart) {
    var box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + chart.id;
    var h = document.createElement("h3");
    h.textContent = chart.title;
    box.appendChild(h);
    root.appendChild(box);
    var series = [{}];
    var data = [chart.x];
    chart.series.forEach(function (s, i) {
      series.push({label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5,
                   spanGaps: true, points: {show: !!chart.points}});
      data.push(s.y);
    });
    var width = Math.max(320, box.clientWidth - 16);
    // One sample (one finished job) would make uPlot span years: show an hour around it.
    var xs = {time: true, range: function (u, min, max) {
      return min === max ? [min - 1800, max + 1800] : [min, max];
    }};
    var ys = {size: 56, values: function (u, vals) { return vals.map(compact); }};
    new uPlot({width: width, height: 220, series: series, scales: {x: xs}, axes: [{}, ys],
               legend: {live: false}}, data, box);
  }
  function main() {
    var src = document.getElementById("chart-data");
    var root = document.getElementById("charts");
    if (!src || !root || typeof uPlot === "undefined") { return; }
    var spec = JSON.parse(src.textContent);
    if (!spec.charts.length) {
      root.textContent = "No telemetry recorded yet.";
      return;
    }
    spec.charts.forEach(function (c) { draw(root, c); });
    root.setAttribute("data-ready", String(spec.charts.length));
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", main);
  } else {
    main();
  }
})();
