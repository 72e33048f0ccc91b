/* mlxhost: the usage chart of the admin (KEY-3): prompt, cached and output tokens per day, drawn
   with uPlot (vendored) from a JSON data block (json_script), so the page needs no inline script
   under Content-Security-Policy script-src 'self'. */
(function () {
  "use strict";

  var DAY = 86400;

  function colors() {
    var css = getComputedStyle(document.documentElement);
    return {
      fg: css.getPropertyValue("--body-quiet-color").trim() || "#666",
      grid: css.getPropertyValue("--hairline-color").trim() || "#e8e8e8",
    };
  }

  function draw(box) {
    var source = document.getElementById(box.getAttribute("data-chart-data"));
    if (!source || !window.uPlot) return;
    var data = JSON.parse(source.textContent);
    var c = colors();
    var axis = { stroke: c.fg, grid: { stroke: c.grid, width: 1 }, ticks: { stroke: c.grid } };
    var point = { show: true, size: 6 };
    var chart = new window.uPlot(
      {
        width: Math.max(200, box.clientWidth),
        height: 180,
        // Days are UTC days: label them so in every browser's time zone.
        tzDate: function (ts) { return window.uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); },
        scales: { x: { time: true }, y: { range: function (_u, _min, max) { return [0, Math.max(1, max)]; } } },
        // Ticks on whole days (or weeks, months when many), never at noon.
        axes: [
          Object.assign({ incrs: [DAY, 2 * DAY, 7 * DAY, 14 * DAY, 28 * DAY], values: "{M}/{D}" }, axis),
          Object.assign({ size: 60 }, axis),
        ],
        cursor: { drag: { x: false, y: false } },
        series: [
          { value: "{YYYY}-{MM}-{DD}" },
          { label: "prompt", stroke: "#417690", width: 2, points: point },
          { label: "cached", stroke: "#79aec8", width: 2, dash: [4, 4], points: point },
          { label: "output", stroke: "#ba2121", width: 2, points: point },
        ],
      },
      [data.t, data.prompt, data.cached, data.output],
      box
    );
    window.addEventListener("resize", function () {
      var width = box.clientWidth;
      if (width > 0) chart.setSize({ width: width, height: chart.height });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".mlxhost-usage-chart[data-chart-data]").forEach(draw);
  });
})();
