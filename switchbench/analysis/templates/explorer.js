"use strict";
// The routing explorer's behaviour. Every text is set with textContent, never parsed as HTML, so a token such as
// "<", "&" or a quote shows as itself. The data block is the analysis of each model on each sequence, see
// switchbench/analysis/explorer.py: attention as bytes of 1/levels per cell, [head][destination][source].
(() => {
  const data = JSON.parse(document.getElementById("explorer-data").textContent);
  const byId = (id) => document.getElementById(id);
  const range = (n) => [...Array(n).keys()];
  const controls = {
    sequence: byId("sequence"), model: byId("model"), layer: byId("layer"), head: byId("head"),
    compare: byId("compare"), other: byId("other"),
  };
  const TOP = 5; // sources listed in the panel
  const state = { sequence: 0, layer: 0, head: -1, dest: 0, pinned: false, compare: false };
  state.model = preferred((model) => model.routing === "experts", -1);
  state.other = preferred((model) => model.baseline, state.model);
  const decoded = new Map(); // "model/sequence/layer" -> Uint8Array
  let sourceKey = null; // what the source-expert rows were drawn for

  // The first model other than `avoid` that `wanted` accepts, else the first other than `avoid`.
  function preferred(wanted, avoid) {
    const others = range(data.models.length).filter((m) => m !== avoid);
    return others.find((m) => wanted(data.models[m])) ?? others[0] ?? 0;
  }

  function element(tag, attributes = {}, text) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const tokens = () => data.sequences[state.sequence].tokens;
  const layersOf = (m) => data.models[m].sequences[state.sequence].length;
  const layerOf = (m) => Math.min(state.layer, layersOf(m) - 1); // a model with fewer layers shows its last

  function attention(m, layer) {
    const key = `${m}/${state.sequence}/${layer}`;
    if (!decoded.has(key)) {
      const text = atob(data.models[m].sequences[state.sequence][layer].attention);
      const bytes = new Uint8Array(text.length);
      for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
      decoded.set(key, bytes);
    }
    return decoded.get(key);
  }

  // The destination's weights over the sources: one head, or the maximum over heads (head -1).
  function row(m, layer, head, dest) {
    const t = tokens().length, bytes = attention(m, layer), weights = new Array(t).fill(0);
    for (const h of head < 0 ? range(data.models[m].heads) : [head]) {
      for (let j = 0; j < t; j++) weights[j] = Math.max(weights[j], bytes[(h * t + dest) * t + j]);
    }
    return weights.map((q) => q / data.levels);
  }

  // What one side picked at a position: [{head, expert, gate}] of one head, or of every head (head -1).
  function choices(m, layer, side, position, head) {
    const picked = data.models[m].sequences[state.sequence][layer][side];
    if (!picked) return [];
    const heads = data.models[m].heads, found = [];
    for (const h of head < 0 ? range(heads) : [head]) {
      for (let c = 0; c < picked.k; c++) {
        const i = (position * heads + h) * picked.k + c;
        found.push({ head: h, expert: picked.experts[i], gate: picked.gates[i] / data.gate_scale });
      }
    }
    return found;
  }

  function fill(select, options, chosen) {
    select.replaceChildren(...options.map(([value, label]) => element("option", { value: String(value) }, label)));
    select.value = String(chosen);
  }

  function modelChanged() {
    const model = data.models[state.model];
    state.layer = Math.min(state.layer, layersOf(state.model) - 1);
    state.head = Math.min(state.head, model.heads - 1);
    fill(controls.layer, range(layersOf(state.model)).map((l) => [l, `layer ${l}`]), state.layer);
    const name = model.slots ? "head slot" : "head"; // MoA: which expert fills a slot varies
    fill(controls.head, [[-1, `max over ${model.heads} heads`], ...range(model.heads).map((h) => [h, `${name} ${h}`])],
      state.head);
  }

  // The token rows of the sequence: the main one (focusable) and the compare one.
  function build() {
    const sequence = data.sequences[state.sequence];
    for (const [container, main] of [[byId("tokens"), true], [byId("compare-tokens"), false]]) {
      const nodes = [];
      sequence.tokens.forEach((label, position) => {
        const node = element("span", { class: "tok", "data-pos": String(position) });
        node.append(element("span", { class: "label" }, label));
        if (main) {
          node.setAttribute("role", "option");
          node.tabIndex = position === state.dest ? 0 : -1;
          node.append(element("span", { class: "src" }));
        }
        nodes.push(node);
        if (sequence.line_ends.includes(position)) nodes.push(element("span", { class: "line-end", "aria-hidden": "true" }));
      });
      container.replaceChildren(...nodes);
    }
    sourceKey = null;
    update();
  }

  const gateText = (gate) => gate.toFixed(3);

  // Under every source token, the experts its source side picked (one line per head in max mode).
  function drawSourceExperts() {
    const key = `${state.model}/${state.sequence}/${state.layer}/${state.head}`;
    if (key === sourceKey) return;
    sourceKey = key;
    const all = state.head < 0;
    byId("tokens").querySelectorAll(".tok").forEach((node, position) => {
      const lines = new Map();
      for (const choice of choices(state.model, state.layer, "src", position, state.head)) {
        if (lines.has(choice.head)) lines.get(choice.head).append(",");
        else lines.set(choice.head, element("span", { class: "src-head" }, all ? `h${choice.head}:` : ""));
        lines.get(choice.head).append(element("span", {
          class: "src-expert", "data-head": String(choice.head), "data-expert": String(choice.expert),
          "data-gate": gateText(choice.gate), title: `head ${choice.head}: expert ${choice.expert}, gate ${gateText(choice.gate)}`,
        }, String(choice.expert)));
      }
      node.querySelector(".src").replaceChildren(...lines.values());
    });
  }

  // Shade each token by its weight relative to the row's largest, and keep the exact weight on the element.
  function shade(container, weights, main) {
    const top = Math.max(...weights) || 1;
    container.querySelectorAll(".tok").forEach((node, position) => {
      const relative = weights[position] / top;
      node.style.setProperty("--w", relative.toFixed(3));
      node.dataset.weight = weights[position].toFixed(4);
      node.classList.toggle("dark", relative > 0.55);
      node.classList.toggle("dest", position === state.dest);
      node.classList.toggle("pinned", main && position === state.dest && state.pinned);
      if (main) node.setAttribute("aria-selected", String(position === state.dest));
      const experts = [...node.querySelectorAll(".src-expert")].map((e) => e.title).join("; ");
      node.title = `${position} ${tokens()[position]}: weight ${weights[position].toFixed(3)}${experts ? `; ${experts}` : ""}`;
    });
  }

  function strongest(weights) {
    const list = element("ol", { class: "top-sources" });
    range(weights.length).sort((a, b) => weights[b] - weights[a] || a - b).slice(0, TOP).forEach((j) => {
      const item = element("li", { "data-pos": String(j), "data-weight": weights[j].toFixed(4) }, `position ${j} `);
      item.append(element("code", {}, tokens()[j]), `: ${weights[j].toFixed(3)}`);
      list.append(item);
    });
    return list;
  }

  function expertList(picked, className, routing, slots) {
    const list = element("ul", { class: className });
    for (const choice of picked) {
      const text = routing !== "heads" ? `head ${choice.head}: expert ${choice.expert}, gate ${gateText(choice.gate)}`
        : slots ? `slot ${choice.head}: head (expert) ${choice.expert}, weight ${gateText(choice.gate)}`
        : `head ${choice.head}: weight ${gateText(choice.gate)}`;
      const item = element("li", {
        class: className.replace(/s$/, ""), "data-head": String(choice.head), "data-expert": String(choice.expert),
        "data-gate": gateText(choice.gate),
      }, text);
      const bar = element("span", { class: "gate", "aria-hidden": "true" });
      const level = element("span");
      level.style.width = `${Math.round(100 * Math.min(choice.gate, 1))}%`;
      bar.append(level);
      item.append(bar);
      list.append(item);
    }
    return list;
  }

  function drawPanel(weights, compared) {
    const model = data.models[state.model], dest = state.dest, parts = [];
    const heading = element("h2", {}, `destination ${dest} `);
    heading.append(element("code", {}, tokens()[dest]), state.pinned ? " (pinned)" : "");
    const scope = state.head < 0 ? `max over ${model.heads} heads` : `head ${state.head}`;
    parts.push(heading, element("p", { class: "muted" }, `${model.name}, layer ${state.layer}, ${scope}`));
    if (model.sides.dst) {
      parts.push(element("h3", {}, `destination side: ${model.sides.dst}`),
        expertList(choices(state.model, state.layer, "dst", dest, state.head), "dst-experts", model.routing, model.slots));
    }
    if (model.sides.src) {
      parts.push(element("h3", {}, `this token's source side: ${model.sides.src}`),
        expertList(choices(state.model, state.layer, "src", dest, state.head), "own-src-experts", model.routing, false));
    }
    if (!model.sides.dst && !model.sides.src) parts.push(element("p", { class: "muted" }, "dense attention: no experts"));
    parts.push(element("h3", {}, "strongest sources"), strongest(weights));
    if (compared) {
      parts.push(element("h3", {}, `${compared.name}, layer ${compared.layer}, max over heads`), strongest(compared.weights));
    }
    byId("panel").replaceChildren(...parts);
  }

  function update() {
    const model = data.models[state.model];
    const weights = row(state.model, state.layer, state.head, state.dest);
    drawSourceExperts();
    shade(byId("tokens"), weights, true);
    const scope = state.head < 0 ? `maximum over its ${model.heads} heads` : `head ${state.head}`;
    byId("row-title").textContent = `${model.name}, layer ${state.layer}, ${scope}: where destination ${state.dest} attends`;
    let compared = null;
    byId("compare-row").hidden = !state.compare;
    if (state.compare) {
      const other = data.models[state.other], layer = layerOf(state.other);
      compared = { name: other.name, layer, weights: row(state.other, layer, -1, state.dest) };
      shade(byId("compare-tokens"), compared.weights, false);
      byId("compare-title").textContent = `${other.name}, layer ${layer}, maximum over its ${other.heads} heads, same destination`;
    }
    drawPanel(weights, compared);
    byId("status").textContent = state.pinned ? `pinned at ${state.dest}: Escape, Enter or a click releases it`
      : "hover a token, or focus the row and use ← → Home End; Enter or Space pins";
  }

  function setDest(position, focus) {
    state.dest = Math.max(0, Math.min(tokens().length - 1, position));
    const nodes = byId("tokens").querySelectorAll(".tok");
    nodes.forEach((node, j) => { node.tabIndex = j === state.dest ? 0 : -1; });
    if (focus) nodes[state.dest].focus();
    update();
  }

  const position = (event) => {
    const node = event.target.closest(".tok");
    return node ? Number(node.dataset.pos) : null;
  };

  for (const id of ["tokens", "compare-tokens"]) {
    byId(id).addEventListener("mouseover", (event) => {
      const j = position(event);
      if (j !== null && !state.pinned && j !== state.dest) setDest(j, false);
    });
  }
  byId("tokens").addEventListener("click", (event) => {
    const j = position(event);
    if (j === null) return;
    state.pinned = !(state.pinned && j === state.dest);
    setDest(j, true);
  });
  byId("tokens").addEventListener("keydown", (event) => {
    const moves = { ArrowLeft: state.dest - 1, ArrowRight: state.dest + 1, Home: 0, End: tokens().length - 1 };
    if (event.key in moves) setDest(moves[event.key], true);
    else if (event.key === "Enter" || event.key === " ") { state.pinned = !state.pinned; update(); }
    else if (event.key === "Escape") { state.pinned = false; update(); }
    else return;
    event.preventDefault();
  });

  controls.sequence.addEventListener("change", () => {
    state.sequence = Number(controls.sequence.value);
    state.dest = Math.min(state.dest, tokens().length - 1);
    modelChanged();
    build();
  });
  controls.model.addEventListener("change", () => {
    state.model = Number(controls.model.value);
    modelChanged();
    update();
  });
  controls.layer.addEventListener("change", () => { state.layer = Number(controls.layer.value); update(); });
  controls.head.addEventListener("change", () => { state.head = Number(controls.head.value); update(); });
  controls.compare.addEventListener("change", () => { state.compare = controls.compare.checked; update(); });
  controls.other.addEventListener("change", () => { state.other = Number(controls.other.value); update(); });

  fill(controls.sequence, data.sequences.map((s, i) => [i, s.name]), state.sequence);
  fill(controls.model, data.models.map((m, i) => [i, m.name]), state.model);
  fill(controls.other, data.models.map((m, i) => [i, m.name]), state.other);
  controls.compare.disabled = controls.other.disabled = data.models.length < 2;
  modelChanged();
  build();
})();
