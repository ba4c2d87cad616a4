/* Charts of the dashboard, drawn with the vendored Chart.js from data the page embeds. */
(function () {
  "use strict";
  const palette = ["#5146e5", "#0ea5e9", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#ec4899", "#64748b"];
  const grid = "#eef0f5";
  const tick = "#7b8196";

  function baseOptions(extra) {
    return Object.assign({
      responsive: true,
      maintainAspectRatio: false,
      animation: { duration: 250 },
      interaction: { mode: "index", intersect: false },
      plugins: {
        legend: { display: false, labels: { boxWidth: 10, boxHeight: 10, color: "#3b4259", font: { size: 12 } } },
        tooltip: { backgroundColor: "#151a2d", padding: 10, cornerRadius: 8, titleFont: { weight: "600" } },
      },
      scales: {
        x: { grid: { display: false }, ticks: { color: tick, maxRotation: 0, autoSkip: true, maxTicksLimit: 8, font: { size: 11 } },
             border: { color: grid } },
        y: { beginAtZero: true, grid: { color: grid }, border: { display: false }, ticks: { color: tick, font: { size: 11 }, maxTicksLimit: 5 } },
      },
    }, extra || {});
  }

  // Times are shown in UTC, as the tables and reports beside the charts (the pages say so).
  // hourCycle "h23": hour12 false lets some browsers write midnight as 24:00.
  const UTC = { timeZone: "UTC", hourCycle: "h23" };

  function timeLabel(iso, bucket) {
    const d = new Date(iso);
    if (bucket >= 86400) return d.toLocaleDateString([], { month: "short", day: "numeric", timeZone: "UTC" });
    if (bucket >= 3600) return d.toLocaleString([], { ...UTC, month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
    return d.toLocaleTimeString([], { ...UTC, hour: "2-digit", minute: "2-digit" });
  }

  function clock(iso) {
    return new Date(iso).toLocaleTimeString([], { ...UTC, hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  function dayLabel(iso) {
    const [y, m, d] = iso.split("-").map(Number);
    return new Date(Date.UTC(y, m - 1, d)).toLocaleDateString([], { month: "short", day: "numeric", timeZone: "UTC" });
  }

  function dataset(label, values, color, kind) {
    const common = { label, data: values, borderColor: color, backgroundColor: color };
    if (kind === "bar") return Object.assign(common, { borderRadius: 4, maxBarThickness: 26, backgroundColor: color + "cc" });
    // Points only where there is a value: a single busy minute still shows on an otherwise flat line.
    return Object.assign(common, { borderWidth: 2, pointRadius: (ctx) => (ctx.raw ? 2.5 : 0), pointHoverRadius: 4,
      tension: .3, spanGaps: true, fill: kind === "area",
      backgroundColor: kind === "area" ? color + "1f" : color });
  }

  function money(value) {
    const v = Number(value);
    if (v === 0) return "$0";
    // Cents from a dollar up; below, the digits that tell close ticks apart ($0.015, not $0.01 twice).
    if (Math.abs(v) >= 1) return "$" + v.toFixed(2);
    return "$" + v.toFixed(6).replace(/0+$/, "").replace(/\.$/, "");
  }

  const charts = new Map();

  function draw(canvas, config) {
    if (!window.Chart || !canvas) return null;
    const previous = charts.get(canvas);
    if (previous) previous.destroy();
    const chart = new window.Chart(canvas, config);
    charts.set(canvas, chart);
    return chart;
  }

  window.DashboardCharts = {
    palette, timeLabel, clock, dayLabel, money,
    line(canvas, labels, sets, opts) {
      opts = opts || {};
      return draw(canvas, {
        type: opts.bar ? "bar" : "line",
        data: { labels, datasets: sets.map((s, i) => dataset(s.label, s.values, s.color || palette[i], opts.bar ? "bar" : (opts.area ? "area" : "line"))) },
        options: baseOptions({
          plugins: Object.assign(baseOptions().plugins, { legend: Object.assign(baseOptions().plugins.legend, { display: sets.length > 1 }),
            tooltip: Object.assign(baseOptions().plugins.tooltip, opts.tooltip || {}) }),
          scales: (() => {
            const scales = baseOptions().scales;
            if (opts.stacked) { scales.x.stacked = true; scales.y.stacked = true; }
            if (opts.money) scales.y.ticks.callback = money;
            return scales;
          })(),
        }),
      });
    },
    doughnut(canvas, labels, values, opts) {
      opts = opts || {};
      return draw(canvas, {
        type: "doughnut",
        data: { labels, datasets: [{ data: values, backgroundColor: labels.map((_, i) => palette[i % palette.length]), borderWidth: 2, borderColor: "#fff" }] },
        options: { responsive: true, maintainAspectRatio: false, cutout: "68%",
          plugins: { legend: { position: "right", labels: { boxWidth: 10, boxHeight: 10, color: "#3b4259" } },
                     tooltip: Object.assign({ backgroundColor: "#151a2d", padding: 10, cornerRadius: 8 }, opts.tooltip || {}) } },
      });
    },
    json(id) {
      const node = document.getElementById(id);
      return node ? JSON.parse(node.textContent) : null;
    },
  };
})();
