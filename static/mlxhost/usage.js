/* mlxhost: the usage chart of the admin (KEY-3): prompt, cached and output tokens per day as bars
   (cached drawn inside its prompt bar: it is a part of it), and refused requests on an axis of
   their own, drawn with uPlot (vendored) from a JSON data block (json_script), so the page needs
   no inline script under Content-Security-Policy script-src 'self'. Every series is a bar or has
   its points marked, so one day still draws as something readable; a series that is zero on every
   day is said in a note under the chart instead of drawing nothing. */
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

  // 1234567 -> "1.2M": token counts on the axis stay short.
  function compact(value) {
    var abs = Math.abs(value);
    if (abs >= 1e9) return (value / 1e9).toFixed(abs >= 1e10 ? 0 : 1) + "G";
    if (abs >= 1e6) return (value / 1e6).toFixed(abs >= 1e7 ? 0 : 1) + "M";
    if (abs >= 1e3) return (value / 1e3).toFixed(abs >= 1e4 ? 0 : 1) + "k";
    return String(Math.round(value));
  }

  // At least a week wide, most of a day of room at each end: one day of data is a bar with its date
  // under it in a week of context, not three dots on the left edge.
  var MIN_DAYS = 7;

  function xRange(t) {
    if (!t.length) return [0, DAY];
    var last = t[t.length - 1];
    var first = Math.min(t[0], last - (MIN_DAYS - 1) * DAY);
    return [first - DAY * 0.75, last + DAY];
  }

  function bars(align, size) {
    var paths = window.uPlot.paths && window.uPlot.paths.bars;
    return paths ? paths({ size: [size || 0.3, 18], align: align, gap: 1 }) : undefined;
  }

  // "No cached tokens or refused requests on these days.": the series with nothing to draw.
  var NOTHING_WORDS = { cached: "cached tokens", output: "output tokens", refused: "refused requests" };

  function nothingNote(box, data) {
    var empty = Object.keys(NOTHING_WORDS).filter(function (name) {
      return !(data[name] || []).some(function (value) { return value > 0; });
    });
    if (!empty.length) return;
    var words = empty.map(function (name) { return NOTHING_WORDS[name]; });
    var note = document.createElement("p");
    note.className = "mlxhost-chart-note";
    note.textContent = "No " + (words.length > 1 ? words.slice(0, -1).join(", ") + " or " + words[words.length - 1] : words[0]) + " on these days.";
    box.after(note);
  }

  function draw(box) {
    var source = document.getElementById(box.getAttribute("data-chart-data"));
    if (!source || !window.uPlot) return;
    var data = JSON.parse(source.textContent);
    var c = colors();
    var axis = { stroke: c.fg, grid: { stroke: c.grid, width: 1 }, ticks: { stroke: c.grid } };
    var range = xRange(data.t);
    var chart = new window.uPlot(
      {
        width: Math.max(200, box.clientWidth),
        height: 200,
        // Days are UTC days: label them so in every browser's time zone.
        tzDate: function (ts) { return window.uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); },
        scales: {
          x: { time: true, range: function () { return range; } },
          y: { range: function (_u, _min, max) { return [0, Math.max(1, max * 1.1)]; } },
          refused: { range: function (_u, _min, max) { return [0, Math.max(4, Math.ceil(max * 1.1))]; } },
        },
        // Ticks on whole days (or weeks, months when many), never at noon.
        axes: [
          Object.assign({ incrs: [DAY, 2 * DAY, 7 * DAY, 14 * DAY, 28 * DAY], values: "{M}/{D}", label: "day (UTC)", labelSize: 20 }, axis),
          Object.assign({ size: 56, label: "tokens", labelSize: 20, values: function (_u, ticks) { return ticks.map(compact); } }, axis),
          Object.assign({}, axis, { scale: "refused", side: 1, size: 44, label: "refused requests", labelSize: 20, grid: { show: false }, values: function (_u, ticks) { return ticks.map(compact); } }),
        ],
        cursor: { drag: { x: false, y: false } },
        series: [
          { label: "day", value: "{YYYY}-{MM}-{DD}" },
          { label: "prompt tokens", stroke: "#417690", fill: "rgba(65,118,144,0.55)", width: 1, paths: bars(-1), points: { show: false } },
          { label: "of which cached", stroke: "#264b5d", fill: "rgba(38,75,93,0.8)", width: 1, paths: bars(-1, 0.18), points: { show: false } },
          { label: "output tokens", stroke: "#ba2121", fill: "rgba(186,33,33,0.55)", width: 1, paths: bars(1), points: { show: false } },
          { label: "refused requests", scale: "refused", stroke: "#e0a800", width: 2, points: { show: true, size: 9, fill: "#e0a800" } },
        ],
      },
      [data.t, data.prompt, data.cached, data.output, data.refused || data.t.map(function () { return 0; })],
      box
    );
    nothingNote(box, data);
    box.mlxhostChart = chart; // for the browser tests, with how each series draws
    box.mlxhostDrawn = { "prompt tokens": "bar", "of which cached": "bar", "output tokens": "bar", "refused requests": "points" };
    window.addEventListener("resize", function () {
      var width = box.clientWidth;
      if (width > 0) chart.setSize({ width: width, height: chart.height });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".mlxhost-usage-chart[data-chart-data]").forEach(draw);
  });
})();
