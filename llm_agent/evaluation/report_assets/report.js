/* The report's dialogue browser: filters, full-text search, paging and a transcript view, in plain JavaScript.

   The data is the JSON document in <script id="dialogue-data">, parsed once. Only the visible page of rows is
   rendered, so 10,000+ dialogues stay fast. Every text from the data is inserted with textContent, never as
   HTML. A dialogue has the keys:
     i index, id dialogue_id, step, split, o outcome, s initial state (one value per data.dims), b behaviour
     indices into data.behaviors, n turns, r reward, rc reward components, ch cache hits, fe format errors,
     e error, lb failure labels {label: turns carrying it}, t turns.
   A turn: at agent text (raw), ar agent reply, as agent stage, ast agent status, ae agent's state estimate,
     ok agent format ok, ur user reply, us user status, ue user state, src user source (simulator | cache |
     format_error), err user-side error, dx failure labels of the turn [[label, note], ...]. */
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("dialogue-data").textContent);
  const dialogues = data.dialogues;
  const STATUS = {"1": "completed (1)", "0": "continue (0)", "-1": "ended (-1)"};
  const $ = (id) => document.getElementById(id);
  const state = {matches: dialogues, page: 0, pageSize: 50, selected: null};
  let haystacks = null;  // lower-case search text per dialogue, built on the first search

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    return typeof value === "number" && !Number.isInteger(value) ? value.toFixed(digits === undefined ? 2 : digits)
      : String(value);
  }

  function stateText(s) {
    if (!s) return "–";
    return data.dims.map((d, k) => d[0].toUpperCase() + "=" + fmt(s[k])).join(" ");
  }

  function stageText(id) {
    if (id === null || id === undefined) return "–";
    const name = data.stages[String(id)];
    return name ? id + " · " + name : String(id);
  }

  function behaviorText(d) {
    return d.b.map((k) => data.behaviors[k].category).join(", ");
  }

  /* ---------------------------------------------------------------------------------------------- filters */
  function addOptions(select, values, label) {
    for (const value of values) select.append(el("option", {value: String(value), text: label ? label(value) : String(value)}));
  }

  function initFilters() {
    const count = (fn) => {
      const c = new Map();
      for (const d of dialogues) { const k = fn(d); c.set(k, (c.get(k) || 0) + 1); }
      return c;
    };
    const outcomes = count((d) => d.o);
    addOptions($("f-outcome"), data.outcomes.filter((o) => outcomes.has(o)), (o) => o + " (" + outcomes.get(o) + ")");
    const splits = count((d) => d.split);
    addOptions($("f-split"), [...splits.keys()].sort(), (s) => s + " (" + splits.get(s) + ")");
    data.dims.forEach((dim, k) => {  // one filter per state dimension of the scenario
      const select = el("select", {id: "f-" + dim});
      select.append(el("option", {value: "", text: "any"}));
      const label = el("label", {text: dim});
      label.append(select);
      $("f-dims").append(label);
      const values = [...new Set(dialogues.map((d) => d.s[k]))].filter((v) => v !== null).sort((a, b) => a - b);
      addOptions(select, values);
    });
    const byCategory = new Map();
    data.behaviors.forEach((b, k) => {
      if (!byCategory.has(b.category)) byCategory.set(b.category, []);
      byCategory.get(b.category).push(k);
    });
    for (const category of [...byCategory.keys()].sort()) {
      const group = el("optgroup", {label: category});
      group.append(el("option", {value: "cat:" + category, text: "any " + category + " behaviour"}));
      for (const k of byCategory.get(category)) group.append(el("option", {value: "beh:" + k, text: data.behaviors[k].behavior}));
      $("f-behavior").append(group);
    }
    const steps = dialogues.map((d) => d.step).filter((s) => typeof s === "number");
    if (steps.length) {
      $("f-step-min").placeholder = String(steps.reduce((a, b) => Math.min(a, b)));
      $("f-step-max").placeholder = String(steps.reduce((a, b) => Math.max(a, b)));
    }
    for (const id of ["f-outcome", "f-split", "f-behavior", "f-step-min", "f-step-max", "page-size",
                      ...data.dims.map((d) => "f-" + d)]) {
      $(id).addEventListener("change", () => applyFilters());
    }
    let timer = null;
    $("f-search").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(applyFilters, 150); });
    $("f-reset").addEventListener("click", () => {
      for (const node of document.querySelectorAll("#filters select, #filters input")) node.value = "";
      $("page-size").value = "50";
      applyFilters();
    });
    $("prev").addEventListener("click", () => { if (state.page > 0) { state.page--; renderRows(); } });
    $("next").addEventListener("click", () => {
      if ((state.page + 1) * state.pageSize < state.matches.length) { state.page++; renderRows(); }
    });
  }

  function searchText(d) {
    const parts = [d.id, d.o, d.split, d.e || ""];
    for (const k of d.b) parts.push(data.behaviors[k].category, data.behaviors[k].behavior);
    parts.push(Object.keys(d.lb || {}).join(" "));
    for (const t of d.t) parts.push(t.at || "", t.ar || "", t.ur || "", t.err || "");
    return parts.join("\n").toLowerCase();
  }

  function applyFilters() {
    const outcome = $("f-outcome").value, split = $("f-split").value, behavior = $("f-behavior").value;
    const stepMin = $("f-step-min").value === "" ? null : Number($("f-step-min").value);
    const stepMax = $("f-step-max").value === "" ? null : Number($("f-step-max").value);
    const dims = data.dims.map((dim) => $("f-" + dim).value === "" ? null : Number($("f-" + dim).value));
    const query = $("f-search").value.trim().toLowerCase();
    const terms = query ? query.split(/\s+/) : [];
    if (terms.length && haystacks === null) haystacks = dialogues.map(searchText);
    let behIndex = null, behCategory = null;
    if (behavior.startsWith("beh:")) behIndex = Number(behavior.slice(4));
    else if (behavior.startsWith("cat:")) behCategory = behavior.slice(4);
    state.matches = dialogues.filter((d) => {
      if (outcome && d.o !== outcome) return false;
      if (split && d.split !== split) return false;
      if (stepMin !== null && !(d.step >= stepMin)) return false;
      if (stepMax !== null && !(d.step <= stepMax)) return false;
      for (let k = 0; k < dims.length; k++) if (dims[k] !== null && d.s[k] !== dims[k]) return false;
      if (behIndex !== null && !d.b.includes(behIndex)) return false;
      if (behCategory !== null && !d.b.some((k) => data.behaviors[k].category === behCategory)) return false;
      if (terms.length) { const h = haystacks[d.i]; for (const term of terms) if (!h.includes(term)) return false; }
      return true;
    });
    state.pageSize = Number($("page-size").value || 50);
    state.page = 0;
    renderRows();
  }

  /* ------------------------------------------------------------------------------------------------- rows */
  function renderRows() {
    const start = state.page * state.pageSize;
    const page = state.matches.slice(start, start + state.pageSize);
    const body = $("dlg-rows");
    body.replaceChildren(...page.map((d) => {
      const row = el("tr", {"data-index": String(d.i), class: d.i === state.selected ? "selected" : ""},
        el("td", {text: d.id}), el("td", {text: fmt(d.step)}), el("td", {text: d.split}),
        el("td", {}, el("span", {class: "badge o-" + d.o, text: d.o})), el("td", {text: stateText(d.s)}),
        el("td", {class: "beh", text: behaviorText(d)}), el("td", {class: "num", text: fmt(d.n)}),
        el("td", {class: "num", text: fmt(d.r)}), el("td", {class: "num", text: fmt(d.ch)}),
        el("td", {class: "num", text: fmt(d.fe)}));
      row.addEventListener("click", () => showTranscript(d.i));
      return row;
    }));
    const total = state.matches.length;
    $("count").textContent = total === 0 ? "No dialogue matches (" + dialogues.length + " in all)."
      : "Showing " + (start + 1) + "–" + (start + page.length) + " of " + total + " matching dialogues (" +
        dialogues.length + " in all).";
    $("count").dataset.matches = String(total);
    $("page-info").textContent = "page " + (total ? state.page + 1 : 0) + " / " + Math.ceil(total / state.pageSize);
    $("prev").disabled = state.page === 0;
    $("next").disabled = start + state.pageSize >= total;
  }

  /* ------------------------------------------------------------------------------------------- transcript */
  function keyValues(pairs) {
    const list = el("dl", {class: "kv"});
    for (const [key, value] of pairs) list.append(el("dt", {text: key}), el("dd", {text: value}));
    return list;
  }

  function turnView(t, k) {
    const agent = el("div", {class: "side agent" + (t.ok === false ? " bad" : "") + (t.dx && t.dx.length ? " labelled" : "")},
      el("div", {class: "who", text: "Agent" + (t.ok === false ? " · format error" : "")}),
      el("div", {class: "utter", text: t.ar !== null && t.ar !== undefined ? t.ar : "(no reply parsed)"}),
      keyValues([["stage", stageText(t.as)], ["status", STATUS[String(t.ast)] || fmt(t.ast)],
                 ["estimate", stateText(t.ae)]]
        .concat(t.dx && t.dx.length ? [["diagnosis", t.dx.map(([l, n]) => n ? l + " (" + n + ")" : l).join("; ")]] : [])),
      el("details", {}, el("summary", {text: "raw output"}), el("pre", {text: t.at || ""})));
    const source = t.src === "cache" ? "User · cache hit" : t.src === "format_error" ? "Format note" : "User";
    const user = el("div", {class: "side user" + (t.src === "cache" ? " cached" : "") + (t.err ? " bad" : "")},
      el("div", {class: "who", text: source}),
      el("div", {class: "utter", text: t.ur !== null && t.ur !== undefined ? t.ur : "(no user turn)"}),
      keyValues([["state", stateText(t.ue)], ["status", STATUS[String(t.us)] || fmt(t.us)],
                 ["source", t.src || "–"]].concat(t.err ? [["error", t.err]] : [])));
    return el("div", {class: "turn"}, el("div", {class: "turn-no", text: "Turn " + (k + 1)}), agent, user);
  }

  function showTranscript(index) {
    const d = dialogues[index];
    state.selected = index;
    for (const row of document.querySelectorAll("#dlg-rows tr")) {
      row.classList.toggle("selected", row.dataset.index === String(index));
    }
    const panel = $("transcript");
    const components = d.rc ? Object.entries(d.rc).map(([k, v]) => [k, fmt(v, 3)]) : [];
    panel.replaceChildren(
      el("h3", {}, "Dialogue " + d.id + " ", el("span", {class: "badge o-" + d.o, text: d.o})),
      el("div", {class: "meta"},
        keyValues([["step", fmt(d.step)], ["split", d.split], ["initial state", stateText(d.s)],
                   ["turns", fmt(d.n)], ["cache hits", fmt(d.ch)], ["format errors", fmt(d.fe)]]
          .concat(d.e ? [["error", d.e]] : [])
          .concat(d.lb && Object.keys(d.lb).length
            ? [["failure labels", Object.entries(d.lb).map(([l, n]) => l + " ×" + n).join(", ")]] : [])),
        keyValues([["reward", fmt(d.r, 3)]].concat(components))),
      el("ul", {class: "behaviors"}, ...d.b.map((k) => el("li", {},
        el("b", {text: data.behaviors[k].category + ": "}), data.behaviors[k].behavior))),
      el("div", {class: "turns"}, ...d.t.map(turnView)));
    panel.hidden = false;
    panel.scrollIntoView({block: "nearest"});
  }

  initFilters();
  applyFilters();
})();
