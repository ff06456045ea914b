/* treegrpo forest viewer. Data: #tg-index (parsed at load) and #tg-f<i> (one forest each, parsed
   when selected). Every string from the data is put into the page with textContent or as an SVG
   text node: model output is untrusted and never parsed as HTML. */
(function () {
  "use strict";
  const t0 = performance.now();
  const $ = (id) => document.getElementById(id);
  const SVGNS = "http://www.w3.org/2000/svg";
  const index = JSON.parse($("tg-index").textContent);
  const parsed = new Map();
  const state = { step: 0, forest: -1, tree: -1, node: null };
  const DX = 42, DY = 62, R = 11, PAD = 28;

  function forestDoc(i) {
    if (!parsed.has(i)) parsed.set(i, JSON.parse($("tg-f" + i).textContent));
    return parsed.get(i);
  }

  function el(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid instanceof Node ? kid : String(kid));
    return e;
  }

  function sv(tag, attrs) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  const fmt = (x, d = 3) => (x === undefined || x === null ? "–" : Number(x).toFixed(d));
  const int = (x) => (x === undefined || x === null ? "–" : Math.round(x).toLocaleString("en-US"));

  // -- colours ------------------------------------------------------------------------------------
  function mix(a, b, t) {
    t = Math.max(0, Math.min(1, t));
    return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * t)).join(",") + ")";
  }
  const NEG = [178, 24, 43], MID = [247, 247, 247], POS = [33, 102, 172];
  const R0 = [200, 200, 200], R1 = [26, 152, 80];
  function advColor(a, m) {
    if (a === undefined || a === null) return "#ffffff";
    const t = m > 0 ? a / m : 0;
    return t < 0 ? mix(MID, NEG, -t) : mix(MID, POS, t);
  }
  const rewardColor = (r, lo, hi) => mix(R0, R1, hi > lo ? (r - lo) / (hi - lo) : 0);
  const logpColor = (lp) => mix([255, 255, 255], [165, 0, 38], Math.min(1, -lp / 5));
  const entColor = (e, m) => mix([255, 255, 255], [84, 39, 143], m > 0 ? e / m : 0);
  const ANCHOR = ["#e6550d", "#31a354", "#756bb1", "#de2d26", "#3182bd", "#636363", "#d6616b", "#8c6d31", "#17becf", "#bcbd22"];
  const anchorOf = (n) => (n.extra && n.extra.anchor_group !== undefined ? n.extra.anchor_group : undefined);
  const anchorColor = (g) => ANCHOR[g % ANCHOR.length];

  // -- header and navigation ------------------------------------------------------------------------
  function header() {
    const run = index.run || {};
    const cfg = run.config || {};
    const top = $("top");
    top.append(el("h1", {}, "treegrpo · " + (run.name || "forests")));
    const shape = cfg.sampler === "chain" ? "G=" + cfg.group_size
      : cfg.sampler === "eptree" ? "(M,N,L,T)=(" + [cfg.m, cfg.n, cfg.l, cfg.t].join(",") + ")"
      : cfg.sampler ? "(M,N,L)=(" + [cfg.m, cfg.n, cfg.l].join(",") + ") " + (cfg.expand_mode || "") : null;
    const kv = (k, v) => (v === undefined || v === null ? null : el("span", { class: "kv" }, k + " ", el("b", {}, String(v))));
    top.append(...[kv("sampler", cfg.sampler), kv("shape", shape), kv("advantage", cfg.advantage || cfg.estimator),
      kv("steps", cfg.steps), kv("forests", index.steps.reduce((s, x) => s + x.prompts.length, 0)),
      el("span", { class: "kv", id: "stepinfo" })].filter(Boolean));
  }

  function side() {
    const nav = $("side");
    const sel = el("select", { id: "stepsel", onchange: (e) => selectStep(+e.target.value, 0) });
    index.steps.forEach((s, k) => {
      const rm = s.prompts.reduce((a, p) => a + p.reward_mean, 0) / Math.max(1, s.prompts.length);
      sel.append(el("option", { value: k }, (s.step === null ? s.file : "step " + s.step) + " · r̄ " + fmt(rm, 2)));
    });
    const filt = el("input", { id: "filter", type: "search", placeholder: "filter prompts…", oninput: () => listPrompts() });
    nav.append(el("label", { for: "stepsel" }, "Step"), sel, el("label", { for: "filter" }, "Prompts"), filt,
      el("ul", { id: "prompts" }));
  }

  function listPrompts() {
    const ul = $("prompts");
    ul.replaceChildren();
    const q = ($("filter").value || "").toLowerCase();
    for (const p of index.steps[state.step].prompts) {
      if (q && !(p.prompt_id + " " + p.question).toLowerCase().includes(q)) continue;
      const bar = el("span", { class: "rbar" }, el("span"));
      bar.firstChild.style.width = Math.round(100 * Math.max(0, Math.min(1, p.reward_mean))) + "%";
      const li = el("li", { "data-i": p.i, title: p.question || p.prompt_id, onclick: () => selectForest(p.i) },
        el("span", { class: "pid" }, p.prompt_id), bar, el("span", { class: "num" }, p.leaves));
      if (p.i === state.forest) li.classList.add("sel");
      ul.append(li);
    }
  }

  function stepPrompts() { return index.steps[state.step].prompts; }
  function rowOf(i) { return stepPrompts().find((p) => p.i === i); }

  function selectStep(k, pos) {
    state.step = Math.max(0, Math.min(index.steps.length - 1, k));
    $("stepsel").value = String(state.step);
    const s = index.steps[state.step];
    const m = (index.run.metrics || {})[String(s.step)] || {};
    const info = [];
    if ("reward/mean" in m) info.push("reward " + fmt(m["reward/mean"]));
    if ("eval/success_greedy" in m) info.push("held-out greedy " + fmt(m["eval/success_greedy"]));
    if ("eval/success_sampled" in m) info.push("sampled " + fmt(m["eval/success_sampled"]));
    if ("actor/entropy" in m) info.push("entropy " + fmt(m["actor/entropy"]));
    $("stepinfo").textContent = info.join(" · ");
    const ps = s.prompts;
    if (ps.length) selectForest(ps[Math.max(0, Math.min(ps.length - 1, pos))].i);
  }

  function selectForest(i) {
    state.forest = i;
    state.tree = -1;
    state.node = null;
    listPrompts();
    const li = $("prompts").querySelector('li[data-i="' + i + '"]');
    if (li && li.scrollIntoView) li.scrollIntoView({ block: "nearest" });
    drawForest();
    $("detail").replaceChildren(el("p", { class: "hint" }, "Click a node to see its text, observation, reward, advantage and per-token log-probs."));
    location.replace("#s=" + state.step + "&f=" + i);
  }

  // -- the budget line and legend -----------------------------------------------------------------
  function budgetLine(row, doc) {
    const b = row.budget || {};
    const chips = [row.trees + (row.trees === 1 ? " tree" : " trees"), row.leaves + " trajectories", row.nodes + " nodes",
      "reward mean " + fmt(row.reward_mean, 2), "generated " + int(b.generated_tokens) + " tok"];
    if (b.prefill_tokens !== undefined) chips.push("prefill " + int(b.prefill_tokens) + " tok");
    else if (b.context_tokens !== undefined) chips.push("prefill ≤ " + int(b.context_tokens) + " tok (context read, no prefix reuse)");
    chips.push("tool calls " + int(b.tool_calls));
    if (b.engine_requests !== undefined) chips.push("engine requests " + int(b.engine_requests));
    if (row.anchor_groups !== undefined) chips.push("GiGPO anchor groups " + row.anchor_groups + " shared · " + fmt(100 * row.anchor_shared, 0) + "% of steps");
    const answers = (doc.extra || {}).answers;
    const box = $("budget");
    box.replaceChildren(el("span", { class: "q" }, row.prompt_id + (row.question ? " · " + row.question : "")),
      ...chips.map((c) => el("span", { class: "chip" }, c)),
      Array.isArray(answers) ? el("span", { class: "chip" }, "gold: " + answers.join(" | ")) : null);
  }

  function legend(m, lo, hi, tokenTree, anchors) {
    const g1 = el("span", { class: "grad" }), g2 = el("span", { class: "grad" });
    g1.style.background = "linear-gradient(90deg," + advColor(-1, 1) + "," + advColor(0, 1) + "," + advColor(1, 1) + ")";
    g2.style.background = "linear-gradient(90deg," + rewardColor(lo, lo, hi) + "," + rewardColor(hi, lo, hi) + ")";
    $("legend").replaceChildren(
      el("span", {}, "● node: advantage ", fmt(-m, 2), g1, fmt(m, 2), " (white: not scored)"),
      el("span", {}, "■ leaf: reward ", fmt(lo, 1), g2, fmt(hi, 1), " (ring: advantage)"),
      tokenTree ? el("span", {}, "token segments; number = round; dashed ring = fork point") : el("span", {}, "S search · T tool call (tool names under it) · A answer · ! invalid"),
      ...(anchors ? [el("span", { id: "anchor-legend" }, "◯ coloured ring + g#: GiGPO anchor group (steps from one state; " + anchors + " shared); click a node to mark its group")] : []));
  }

  // -- drawing one forest -----------------------------------------------------------------------------
  function layoutTree(tree) {
    const kids = new Map();
    for (const n of tree.nodes) kids.set(n.id, []);
    let root = null;
    for (const n of tree.nodes) {
      if (n.parent === null || n.parent === undefined) root = n;
      else kids.get(n.parent).push(n.id);
    }
    for (const k of kids.values()) k.sort((a, b) => a - b);
    const pos = new Map();
    let next = 0;
    const stack = [[root.id, false]];
    while (stack.length) { // iterative post-order: leaves left to right, parents centred over children
      const [id, done] = stack.pop();
      const ch = kids.get(id);
      if (!ch.length) { pos.set(id, next++); continue; }
      if (done) { pos.set(id, (pos.get(ch[0]) + pos.get(ch[ch.length - 1])) / 2); continue; }
      stack.push([id, true]);
      for (let j = ch.length - 1; j >= 0; j--) stack.push([ch[j], false]);
    }
    return { kids, pos, root, width: Math.max(1, next) };
  }

  function nodeLabel(n, tokenTree) {
    if (n.parent === null || n.parent === undefined) return "Q";
    const x = n.extra || {};
    if (tokenTree && x.round !== undefined) return String(x.round);
    return { search: "S", tool: "T", answer: "A", invalid: "!", overflow: "…" }[x.kind] || "";
  }

  // Each tool call's latency (extra.tool_latency_s, seconds, one per call), and the summed latency
  // of the calls on the path root → node: the chain of dependent calls this node waited for.
  const latencies = (n) => { const v = (n.extra || {}).tool_latency_s; return Array.isArray(v) ? v.map(Number) : []; };
  function latencyRow(x, path) {
    const own = latencies({ extra: x });
    if (!own.length) return undefined;
    const chain = path.reduce((s, p) => s + latencies(p).reduce((a, b) => a + b, 0), 0);
    return own.map((v) => fmt(v, 3) + " s").join(", ") + " · path " + fmt(chain, 3) + " s";
  }

  // A tool env's step (tag or native protocol) records its messages: the assistant turn with its
  // tool_calls, then one role "tool" message per call with the result the model read.
  function toolCalls(n) {
    const msgs = (n.extra || {}).messages;
    const calls = [], results = [];
    if (!Array.isArray(msgs)) return { calls, results };
    const text = (v) => (typeof v === "string" ? v : JSON.stringify(v === undefined ? null : v));
    for (const m of msgs) {
      if (!m || typeof m !== "object") continue;
      if (m.role === "assistant" && Array.isArray(m.tool_calls)) {
        for (const c of m.tool_calls) {
          const f = (c && typeof c.function === "object" && c.function) || c || {};
          calls.push({ name: String(f.name === undefined ? "?" : f.name), args: text(f.arguments === undefined ? {} : f.arguments) });
        }
      } else if (m.role === "tool") results.push({ name: String(m.name || "tool"), content: text(m.content) });
    }
    return { calls, results };
  }
  const toolNames = (n) => toolCalls(n).calls.map((c) => c.name).join(",");

  function drawForest() {
    const doc = forestDoc(state.forest);
    const row = rowOf(state.forest) || index.steps.flatMap((s) => s.prompts).find((p) => p.i === state.forest);
    const tokenTree = !!row.token_tree;
    let m = 0, lo = 0, hi = 1;
    for (const t of doc.trees) for (const n of t.nodes) {
      if (n.advantage !== undefined) m = Math.max(m, Math.abs(n.advantage));
      if (n.reward !== undefined) { lo = Math.min(lo, n.reward); hi = Math.max(hi, n.reward); }
    }
    const shared = new Set();
    for (const t of doc.trees) for (const n of t.nodes) if (anchorOf(n) !== undefined && (n.extra.anchor_size || 1) > 1) shared.add(anchorOf(n));
    budgetLine(row, doc);
    legend(m, lo, hi, tokenTree, shared.size);
    const lays = doc.trees.map(layoutTree);
    const depth = Math.max(1, ...doc.trees.flatMap((t) => t.nodes.map((n) => n.depth)));
    const width = lays.reduce((s, l) => s + l.width, 0) * DX + (lays.length - 1) * DX + 2 * PAD;
    const height = depth * DY + 2 * PAD + 24;
    const svg = sv("svg", { width, height, viewBox: "0 0 " + width + " " + height, id: "forest" });
    let offset = PAD;
    doc.trees.forEach((tree, ti) => {
      const L = lays[ti];
      const byId = new Map(tree.nodes.map((n) => [n.id, n]));
      const X = (id) => offset + L.pos.get(id) * DX + DX / 2;
      const Y = (n) => PAD + 14 + n.depth * DY;
      const forks = new Set(((tree.extra || {}).forks || []).map((f) => f.node));
      const g = sv("g", { class: "tree", "data-tree": ti });
      const name = sv("text", { x: X(L.root.id), y: PAD - 6, class: "tname" });
      name.textContent = "tree " + ti;
      g.append(name);
      for (const n of tree.nodes) {
        if (n.parent === null || n.parent === undefined) continue;
        const p = byId.get(n.parent);
        const x1 = X(p.id), y1 = Y(p), x2 = X(n.id), y2 = Y(n), ym = (y1 + y2) / 2;
        g.append(sv("path", { class: "edge", "data-child": n.id, d: "M" + x1 + "," + y1 + " C" + x1 + "," + ym + " " + x2 + "," + ym + " " + x2 + "," + y2 }));
      }
      for (const n of tree.nodes) {
        const x = X(n.id), y = Y(n);
        const leaf = !L.kids.get(n.id).length && n.parent !== null && n.parent !== undefined;
        const isRoot = n.parent === null || n.parent === undefined;
        const ng = sv("g", { class: "node", "data-tree": ti, "data-node": n.id, tabindex: 0 });
        const ag = anchorOf(n);
        if (ag !== undefined) ng.setAttribute("data-anchor", ag);
        let shape;
        if (isRoot) shape = sv("rect", { x: x - R, y: y - R, width: 2 * R, height: 2 * R, rx: 3, fill: "#3c4043", stroke: "#3c4043" });
        else if (leaf) shape = sv("rect", { x: x - R, y: y - R, width: 2 * R, height: 2 * R, fill: rewardColor(n.reward ?? 0, lo, hi), stroke: n.advantage === undefined ? "#777" : advColor(n.advantage, m), "stroke-width": n.advantage === undefined ? 1 : 3 });
        else shape = sv("circle", { cx: x, cy: y, r: R, fill: advColor(n.advantage, m), stroke: "#666", "stroke-width": 1 });
        shape.classList.add("shape");
        ng.append(shape);
        if (forks.has(n.id)) ng.append(sv("circle", { cx: x, cy: y, r: R + 4, class: "fork" }));
        if (ag !== undefined && shared.has(ag)) {
          ng.append(sv("circle", { cx: x, cy: y, r: R + 4, class: "anchor", stroke: anchorColor(ag) }));
          const al = sv("text", { x: x + R + 3, y: y - R, class: "albl", fill: anchorColor(ag) });
          al.textContent = "g" + ag;
          ng.append(al);
        }
        const t = sv("text", { x, y, fill: isRoot ? "#fff" : "#222" });
        t.textContent = nodeLabel(n, tokenTree);
        ng.append(t);
        const names = isRoot ? "" : toolNames(n);
        if (names) {
          const tl = sv("text", { x, y: y + R + (leaf ? 18 : 9), class: "tlbl" }); // below, under a leaf's reward
          tl.textContent = names.length > 9 ? names.slice(0, 8) + "…" : names;
          ng.append(tl);
        }
        if (leaf) {
          const lb = sv("text", { x, y: y + R + 9, class: "lbl" });
          lb.textContent = fmt(n.reward, 2);
          ng.append(lb);
        }
        const tip = sv("title");
        tip.textContent = "node " + n.id + (n.advantage !== undefined ? " · A " + fmt(n.advantage) : "") + (n.reward !== undefined ? " · r " + fmt(n.reward, 2) : "") + (ag !== undefined ? " · anchor g" + ag : "") + (names ? " · tools " + names : "");
        ng.append(tip);
        ng.addEventListener("click", () => selectNode(ti, n.id));
        ng.addEventListener("keydown", (e) => { if (e.key === "Enter") selectNode(ti, n.id); });
        g.append(ng);
      }
      svg.append(g);
      offset += (L.width + 1) * DX;
    });
    $("canvas").replaceChildren(svg);
  }

  // -- the detail pane ------------------------------------------------------------------------------
  function strip(values, color, label) {
    const s = el("div", { class: "strip" });
    values.forEach((v, k) => {
      const c = el("span", { title: "#" + k + " " + label + " " + fmt(v) });
      c.style.background = color(v);
      s.append(c);
    });
    return s;
  }

  function selectNode(ti, id) {
    state.tree = ti;
    state.node = id;
    const doc = forestDoc(state.forest);
    const tree = doc.trees[ti];
    const byId = new Map(tree.nodes.map((n) => [n.id, n]));
    const n = byId.get(id);
    const path = [];
    for (let cur = n; cur; cur = cur.parent === null || cur.parent === undefined ? null : byId.get(cur.parent)) path.unshift(cur);
    const onPath = new Set(path.map((p) => p.id));
    for (const e of document.querySelectorAll('#canvas g.tree[data-tree="' + ti + '"] .edge')) e.classList.toggle("on", onPath.has(+e.dataset.child));
    for (const e of document.querySelectorAll("#canvas .edge.on")) if (e.closest("g.tree").dataset.tree !== String(ti)) e.classList.remove("on");
    for (const e of document.querySelectorAll("#canvas .node.sel")) e.classList.remove("sel");
    const g = document.querySelector('#canvas g.node[data-tree="' + ti + '"][data-node="' + id + '"]');
    if (g) g.classList.add("sel");
    for (const e of document.querySelectorAll("#canvas .node.anchor-on")) e.classList.remove("anchor-on");
    const ag = anchorOf(n);
    const peers = ag === undefined ? [] : document.querySelectorAll('#canvas g.node[data-anchor="' + ag + '"]');
    for (const e of peers) e.classList.add("anchor-on");
    const x = n.extra || {};
    const tc = toolCalls(n);
    const isRoot = n.parent === null || n.parent === undefined;
    const kids = tree.nodes.filter((k) => k.parent === id).length;
    const context = path.slice(0, -1).reduce((s, p) => s + p.n_tokens, 0);
    const rows = [
      ["kind", isRoot ? "prompt (root)" : x.kind], ["turn", x.turn], ["round", x.round], ["finish", x.finish_reason],
      ["reward", n.reward === undefined ? undefined : fmt(n.reward)], ["advantage", n.advantage === undefined ? undefined : fmt(n.advantage, 4)],
      ["tokens", n.n_policy + " policy / " + n.n_tokens + " total"], ["context before", int(context) + " tok"],
      ["depth", n.depth], ["children", kids || (isRoot ? 0 : "leaf")],
      ["anchor group", ag === undefined ? undefined : "g" + ag + " · " + (x.anchor_size || peers.length) + " step" + ((x.anchor_size || peers.length) === 1 ? "" : "s") + " from this state"],
      ["tool call", x.kind === "search" && n.observation !== undefined && !x.refused ? "yes (" + (x.query || "") + ")" : undefined],
      ["tool calls", tc.calls.length ? tc.calls.map((c) => c.name).join(", ") + (x.refused ? " (refused: the last turn)"
        : x.tool_calls_ran !== undefined ? " (" + x.tool_calls_ran + " ran)" : "") : undefined],
      ["tool error", x.tool_error],
      ["tool latency", latencyRow(x, path)],
    ].filter((r) => r[1] !== undefined && r[1] !== null);
    const table = el("table", {}, ...rows.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, String(v)))));
    const out = [el("h2", {}, "tree " + ti + " · node " + id), table];
    out.push(el("h3", {}, isRoot ? "Prompt" : "Text"), n.text ? el("pre", { id: "node-text" }, n.text) : el("p", { class: "empty", id: "node-text" }, "(no text)"));
    if (tc.calls.length) out.push(el("h3", {}, "Tool calls"), el("pre", { id: "node-calls" }, tc.calls.map((c) => c.name + "(" + c.args + ")").join("\n")));
    if (tc.results.length) out.push(el("h3", {}, "Tool results"), el("pre", { id: "node-results" }, tc.results.map((r) => r.name + " → " + r.content).join("\n")));
    if (n.observation !== undefined) out.push(el("h3", {}, "Observation"), el("pre", { id: "node-obs" }, n.observation));
    if (n.logprobs && n.logprobs.length) {
      const mean = n.logprobs.reduce((a, b) => a + b, 0) / n.logprobs.length;
      out.push(el("h3", {}, "Log-prob per policy token"), strip(n.logprobs, logpColor, "logp"),
        el("div", { class: "stat" }, "mean " + fmt(mean) + " · min " + fmt(Math.min(...n.logprobs)) + " · white 0 → dark −5"));
    }
    if (n.entropy && n.entropy.length && n.entropy.some((v) => v !== 0)) {
      const em = Math.max(...n.entropy);
      out.push(el("h3", {}, "Entropy per policy token"), strip(n.entropy, (v) => entColor(v, em), "entropy"),
        el("div", { class: "stat" }, "mean " + fmt(n.entropy.reduce((a, b) => a + b, 0) / n.entropy.length) + " · max " + fmt(em)));
    }
    const known = new Set(["kind", "turn", "round", "finish_reason", "query", "anchor_group", "anchor_size", "tool", "tool_calls_ran", "tool_error", "tool_latency_s"]);
    const rest = Object.entries(x).filter(([k]) => !known.has(k));
    if (rest.length) out.push(el("h3", {}, "Other fields"), el("table", {}, ...rest.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, typeof v === "string" ? v : JSON.stringify(v))))));
    if (path.length > 1) {
      const ctx = el("pre");
      ctx.textContent = path.map((p) => (p.text || "") + (p.observation ? "\n" + p.observation : "")).join("\n");
      out.push(el("details", {}, el("summary", {}, "Context: root → node (" + path.length + " nodes)"), ctx));
    }
    $("detail").replaceChildren(...out);
  }

  // -- keys, start ------------------------------------------------------------------------------------
  document.addEventListener("keydown", (e) => {
    if (e.target && (e.target.tagName === "INPUT" || e.target.tagName === "SELECT")) return;
    const ps = stepPrompts();
    const k = ps.findIndex((p) => p.i === state.forest);
    if (e.key === "ArrowDown" || e.key === "j") selectForest(ps[Math.min(ps.length - 1, k + 1)].i);
    else if (e.key === "ArrowUp" || e.key === "k") selectForest(ps[Math.max(0, k - 1)].i);
    else if (e.key === "ArrowRight" || e.key === "l") selectStep(state.step + 1, 0);
    else if (e.key === "ArrowLeft" || e.key === "h") selectStep(state.step - 1, 0);
    else return;
    e.preventDefault();
  });

  header();
  side();
  const h = new URLSearchParams(location.hash.slice(1));
  const s0 = Math.max(0, Math.min(index.steps.length - 1, +(h.get("s") || 0)));
  const f0 = +(h.get("f") || -1);
  const pos0 = Math.max(0, index.steps[s0].prompts.findIndex((p) => p.i === f0));
  selectStep(s0, pos0);
  window.treegrpoView = {
    parsedForests: () => parsed.size,
    firstRenderMs: performance.now(),
    scriptMs: performance.now() - t0,
    select: (step, pos) => selectStep(step, pos),
    selectNode,
  };
  document.body.dataset.ready = "1";
})();
