// sdbench's site: makes every table sortable and searchable (DataTables), wires the filters above a table to its
// columns (exact values), and draws every chart from its figure's JSON (plotly.js). Loaded after the page.
(function () {
  "use strict";
  var DataTable = window.sdbenchTables["default"];
  var tables = {};
  document.querySelectorAll("table.sd-table").forEach(function (element) {
    var rows = element.tBodies[0] ? element.tBodies[0].rows.length : 0;
    tables[element.id] = new DataTable(element, {
      order: [], paging: rows > 200, pageLength: 200, autoWidth: false, scrollX: true,
      language: { search: "Search:" }
    });
  });
  function applyFilter(select) {
    var table = tables[select.dataset.table];
    if (!table) { return; }
    var value = select.value;
    var pattern = value ? "^" + DataTable.util.escapeRegex(value) + "$" : "";
    table.column(Number(select.dataset.column)).search(pattern, true, false);
  }
  var selects = document.querySelectorAll("select.sd-filter");
  selects.forEach(function (select) {
    applyFilter(select);
    select.addEventListener("change", function () {
      applyFilter(select);
      tables[select.dataset.table].draw();
    });
  });
  Object.keys(tables).forEach(function (id) { tables[id].draw(); });
  document.querySelectorAll("script.sd-figure").forEach(function (script) {
    var figure = JSON.parse(script.textContent);
    Plotly.newPlot(script.dataset["for"], figure.data, figure.layout, { displaylogo: false, responsive: true });
  });
  document.body.dataset.ready = "1";
})();
