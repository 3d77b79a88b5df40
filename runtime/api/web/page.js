// The page every node serves at GET / (index.html): a chat box and a view of
// the swarm, read from this node's own API and nothing else.
//
// Safety: model names, node ids, reasons, anything from another node's record
// or from an answer, reach the page only as text: through el() and text(),
// which set textContent, append Text nodes or set plain properties. Nothing
// here parses HTML. (The node also serves this page with a Content-Security-
// Policy that allows no other script and no request beyond this node.)
"use strict";

const STATUS_POLL_MS = 2000;
const MODELS_POLL_MS = 5000;
const QUERY = new URLSearchParams(location.search);
// A dead or left member is shown faded, then dropped from the table once it
// has been so this long (`?drop_after_s=N` changes it).
const DROP_AFTER_S = positiveNumber(QUERY.get("drop_after_s"), 120);
const DEFAULT_RETRY_AFTER_S = 5;
const MAX_RETRY_AFTER_S = 60;
const EVENTS_SHOWN = 12;
const DECISIONS_SHOWN = 3;
const SHORT_ID = 8;
// Why placement has not served a model yet, in words: the codes of
// consensus/placement.py WAIT_MESSAGES (the status's placement.waiting).
const WAIT_REASONS = {
  serving: "the model is served by admitted nodes",
  no_leader: "no placement leader with a quorum is known; placement resumes once one is",
  no_demand: "nobody has asked for this model recently, so nothing is placed for it",
  loading: "nodes are assigned to every missing layer and are loading or running doctor",
  admission_failed: "a node assigned to this model failed admission; trying another",
  no_spare_capacity: "no spare node with this model and enough memory can cover the gaps",
  unknown_model: "no node knows this model's size (no manifest has been seen)",
  demand_recorded: "demand was recorded; the leader places it next",
};

// --- small helpers -----------------------------------------------------------

function positiveNumber(value, fallback) {
  const number = Number(value);
  return value !== null && Number.isFinite(number) && number > 0 ? number : fallback;
}

function $(id) {
  return document.getElementById(id);
}

/** An element whose content is only ever text (or other elements). */
function el(tag, options = {}, ...children) {
  const node = document.createElement(tag);
  if (options.className) node.className = options.className;
  if (options.text !== undefined && options.text !== null) node.textContent = String(options.text);
  if (options.title !== undefined && options.title !== null) node.title = String(options.title);
  for (const [key, value] of Object.entries(options.data || {})) node.dataset[key] = String(value);
  for (const child of children) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

/** obj[key] only if obj has it itself: a model named "constructor" must not
 * find Object's. */
function own(obj, key) {
  return obj && typeof obj === "object" && Object.hasOwn(obj, key) ? obj[key] : undefined;
}

function text(value) {
  return document.createTextNode(value === null || value === undefined ? "-" : String(value));
}

function shortId(id) {
  return typeof id === "string" ? id.slice(0, SHORT_ID) : "-";
}

function nodeLabel(id) {
  return el("span", { className: "node-id", text: shortId(id), title: id });
}

/** "12 s", "3 min", "2 h", "4 d". */
function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "-";
  const s = Math.max(0, seconds);
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h`;
  return `${Math.floor(s / 86400)} d`;
}

/** "just now", "12 s ago", "3 min ago". */
function ago(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "-";
  return seconds < 1 ? "just now" : `${duration(seconds)} ago`;
}

function rate(perSecond) {
  if (typeof perSecond !== "number" || !Number.isFinite(perSecond)) return "-";
  if (perSecond >= 10000) return `${Math.round(perSecond / 1000)}k`;
  if (perSecond >= 1000) return `${(perSecond / 1000).toFixed(1)}k`;
  return String(Math.round(perSecond));
}

/** Layers [a, b) for people: "layers 3–5", "layer 3". */
function layersText(span) {
  const [start, end] = span;
  return end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
}

function spansText(spans) {
  return spans.length ? spans.map(layersText).join(", ") : "none";
}

// --- the layer strip ---------------------------------------------------------

/** One cell per layer, coloured by how many admitted nodes serve it (red:
 * a gap), with a bar per serving node under the layers it covers.
 * `nodes` are the coverage's serving nodes ({node_id, layers, recipe}).
 * `replicas[i]` is a count, or true/false where only covered/gap is known. */
function layerStrip(replicas, nodes = []) {
  const layers = replicas.length;
  const strip = el("div", { className: "strip", data: { layers } });
  strip.style.setProperty("--layers", String(layers));
  if (layers > 48) strip.classList.add("dense");
  replicas.forEach((count, layer) => {
    const known = typeof count === "number";
    const served = known ? count > 0 : Boolean(count);
    let kind = "gap";
    if (served) kind = known ? `r${Math.min(count, 3)}` : "covered";
    const title = served
      ? `layer ${layer}: ${known ? `${count} replica${count === 1 ? "" : "s"}` : "covered"}`
      : `layer ${layer}: gap, nobody serves it`;
    const cell = el("div", {
      className: `layer ${kind}`,
      text: known ? count : "",
      title,
      data: { layer, replicas: known ? count : served ? "?" : 0 },
    });
    cell.style.gridRow = "1";
    cell.style.gridColumn = String(layer + 1);
    strip.append(cell);
  });
  // Bars are packed into as few rows as they fit (replicas stack).
  const rowEnds = [];
  const spans = nodes.filter((n) => Array.isArray(n.layers) && n.layers[0] < n.layers[1] && n.layers[1] <= layers);
  spans.sort((a, b) => a.layers[0] - b.layers[0] || a.layers[1] - b.layers[1]);
  for (const node of spans) {
    const [start, end] = node.layers;
    let row = rowEnds.findIndex((taken) => taken <= start);
    if (row < 0) row = rowEnds.push(end) - 1;
    else rowEnds[row] = end;
    const bar = el("div", {
      className: "span-bar",
      text: shortId(node.node_id),
      title: `${node.node_id}: ${layersText(node.layers)}${node.recipe ? `, ${node.recipe}` : ""}`,
      data: { node: node.node_id },
    });
    bar.style.gridRow = String(row + 2);
    bar.style.gridColumn = `${start + 1} / ${end + 1}`;
    strip.append(bar);
  }
  return strip;
}

function coveredFlags(layers, covered) {
  const flags = new Array(layers).fill(false);
  for (const [start, end] of covered || []) {
    for (let i = Math.max(0, start); i < Math.min(end, layers); i++) flags[i] = true;
  }
  return flags;
}

// --- the swarm view ----------------------------------------------------------

function render(status) {
  // This node's wall clock now, for the wall-clock stamps in its status
  // (demand, decisions), so the browser's own clock does not matter.
  const nodeNow = status.started_at + status.uptime_s;
  const failed = [];
  const parts = [renderSummary, renderNotes, renderModels, renderMembers, renderEvents];
  for (const part of parts) {
    try {
      part(status, nodeNow);
    } catch (err) {
      // One part that cannot read the status leaves the others drawn.
      console.error(err);
      failed.push(`${part.name}: ${err.message || err}`);
    }
  }
  return failed;
}

function renderSummary(s) {
  const alive = s.members.filter((m) => m.state === "alive").length;
  const lost = s.leadership && s.leadership.lost;
  let leader = [text(" · no leader known")];
  if (s.leader) {
    leader = [text(" · leader "), nodeLabel(s.leader), s.leader === s.node_id ? text(" (this node)") : null];
  } else if (lost) {
    leader = [text(" · no leader: "), nodeLabel(lost), text(" is lost")];
  }
  $("summary").replaceChildren(
    text("node "),
    nodeLabel(s.node_id),
    ...leader,
    text(` · term ${s.term} · ${alive} of ${s.members.length} members alive`),
    text(s.swarm ? ` · ${s.swarm.mode} swarm` : ""),
    text(` · up ${duration(s.uptime_s)}`),
    text(s.reachability && s.reachability.verdict !== "unreachable" ? ` · ${s.reachability.says}` : ""),
  );
}

function renderNotes(s) {
  const notes = [];
  if (s.leaving) notes.push("this node is leaving the swarm: it takes no new chats");
  if (s.join && s.join.state === "no peer reached") {
    notes.push(`no peer reached yet (${s.join.attempts} attempts): check the --join addresses`);
  }
  // Peers cannot dial this node back (runtime/node/reachability_driver.py).
  if (s.reachability && s.reachability.verdict === "unreachable") notes.push(s.reachability.says);
  if (s.raft && s.raft.eligibility_warning) notes.push(s.raft.eligibility_warning);
  // No leader named: why, and what to run (runtime/node/leadership.py).
  const leadership = s.leadership;
  if (leadership && leadership.state === "leaderless" && (leadership.lost || leadership.fix)) {
    notes.push([leadership.why, leadership.fix && `what to do: ${leadership.fix}`].filter(Boolean).join(". "));
  }
  const drops = Object.entries(s.drops || {});
  if (drops.length) notes.push(`dropped: ${drops.map(([why, n]) => `${why} ${n}`).join(", ")}`);
  $("notes").replaceChildren(...notes.map((note) => el("div", { className: "note", text: note })));
}

function modelNames(s) {
  const names = new Set(Object.keys(s.coverage || {}));
  for (const name of Object.keys(s.demand || {})) names.add(name);
  const placement = s.placement || {};
  for (const name of Object.keys(placement.waiting || {})) names.add(name);
  for (const name of Object.keys(placement.models || {})) names.add(name);
  for (const entry of s.ledger || []) names.add(entry.model);
  return [...names].sort();
}

function renderModels(s, nodeNow) {
  const placement = s.placement || {};
  const cards = modelNames(s).map((name) => {
    const coverage = own(s.coverage, name);
    const facts = own(placement.models, name);
    const layers = coverage ? coverage.layers : facts ? facts.num_layers : null;
    const complete = Boolean(coverage && coverage.complete);
    const gaps = coverage ? coverage.gaps : layers ? [[0, layers]] : [];
    const missing = gaps.reduce((total, [a, b]) => total + (b - a), 0);
    const servers = coverage ? coverage.nodes : [];
    let badge = el("span", { className: "badge ok", text: "ready" });
    if (!complete) {
      badge = el("span", {
        className: "badge bad",
        text: layers ? `${missing} of ${layers} layers missing` : "not served",
      });
    }
    const about = [
      layers ? `${layers} layers` : "size unknown",
      coverage ? coverage.recipe_class : facts ? facts.recipe : null,
      `${servers.length} serving node${servers.length === 1 ? "" : "s"}`,
    ].filter(Boolean);
    const card = el(
      "div",
      { className: `model-card ${complete ? "complete" : "incomplete"}`, data: { model: name } },
      el(
        "div",
        { className: "model-head" },
        el("strong", { className: "model-name", text: name }),
        badge,
        el("span", { className: "muted", text: about.join(" · ") }),
      ),
    );
    if (layers) {
      const replicas = coverage ? coverage.replicas : new Array(layers).fill(0);
      card.append(layerStrip(replicas, servers));
    }
    if (gaps.length && layers) {
      card.append(el("div", { className: "gap-text", text: `gap: ${spansText(gaps)}` }));
    }
    card.append(demandLine(s, name, nodeNow));
    const waiting = own(placement.waiting, name);
    if (waiting && waiting !== "serving" && !complete) {
      card.append(
        el("div", { className: "why" }, el("span", { className: "label", text: "why it waits: " }),
          text(own(WAIT_REASONS, waiting) || waiting)),
      );
    }
    const decisions = (placement.decisions || []).filter((d) => d.model === name);
    if (decisions.length) {
      card.append(el("ul", { className: "decisions" },
        ...decisions.slice(-DECISIONS_SHOWN).reverse().map((d) => decisionItem(d, nodeNow))));
    }
    return card;
  });
  $("models").replaceChildren(...(cards.length ? cards : [el("div", { className: "muted", text: "no model in this swarm yet" })]));
}

function demandLine(s, name, nodeNow) {
  const demand = own(s.demand, name);
  if (!demand || !demand.count) return el("div", { className: "demand muted", text: "no demand recorded" });
  const last = typeof demand.last_at === "number" ? `, last ${ago(nodeNow - demand.last_at)}` : "";
  return el("div", {
    className: "demand",
    text: `demand: ${demand.count} request${demand.count === 1 ? "" : "s"}${last}`,
  });
}

function decisionItem(d, nodeNow) {
  const when = typeof d.at === "number" ? ` · ${ago(nodeNow - d.at)}` : "";
  return el(
    "li",
    { className: d.accepted === false ? "refused" : "" },
    text(`${d.command || "decision"} `),
    d.node_id ? nodeLabel(d.node_id) : null,
    text(Array.isArray(d.layers) ? ` ${layersText(d.layers)}` : ""),
    text(`: ${d.reason || d.code || ""}`),
    text(d.accepted === false ? " (refused)" : ""),
    el("span", { className: "muted", text: when }),
  );
}

function renderMembers(s, nodeNow) {
  const voters = new Set((s.raft && s.raft.voters) || []);
  const learners = new Set((s.raft && s.raft.learners) || []);
  const notServing = s.not_serving || {};
  // The ledger's records of every node a verdict counted against; those in
  // "quarantined" are benched now and serve nothing.
  const benched = new Set(s.quarantined || []);
  const quarantine = new Map((s.quarantine || []).map((q) => [q.node_id, q]));
  let hidden = 0;
  const rows = [];
  for (const m of s.members) {
    const gone = m.state === "dead" || m.state === "left";
    if (gone && (m.state_for || 0) > DROP_AFTER_S) {
      hidden++;
      continue;
    }
    const isLeader = m.node_id === s.leader;
    const record = m.record || {};
    const classes = ["member", `state-${m.state}`];
    if (gone) classes.push("gone");
    if (isLeader) classes.push("leader");
    const nodeCell = el(
      "td",
      {},
      nodeLabel(m.node_id),
      isLeader ? el("span", { className: "badge leader-mark", text: "★ leader", title: "Raft leader" }) : null,
      s.leadership && m.node_id === s.leadership.lost
        ? el("span", { className: "badge bad lost-leader", text: "lost leader", title: s.leadership.why || "" })
        : null,
      m.self ? el("span", { className: "badge self", text: "this node" }) : null,
      !isLeader && voters.has(m.node_id) ? el("span", { className: "badge", text: "voter" }) : null,
      learners.has(m.node_id) ? el("span", { className: "badge quiet", text: "learner" }) : null,
      benched.has(m.node_id) ? quarantineBadge(quarantine.get(m.node_id), nodeNow) : null,
    );
    rows.push(
      el(
        "tr",
        { className: classes.join(" "), data: { node: m.node_id, state: m.state } },
        nodeCell,
        el("td", {}, el("span", { className: `pill ${m.state}`, text: m.state }),
          el("span", { className: "muted", text: ` for ${duration(m.state_for)}` })),
        el("td", { text: m.self ? "this node" : ago(m.last_seen) }),
        servesCell(record),
        admissionCell(m, s, own(notServing, m.node_id)),
        speedCell(record.capability),
        loadCell(m, s),
      ),
    );
  }
  $("members").tBodies[0].replaceChildren(...rows);
  $("hidden-members").textContent = hidden
    ? `${hidden} dead or left member${hidden === 1 ? "" : "s"} not shown (gone over ${duration(DROP_AFTER_S)})`
    : "";
}

function quarantineBadge(q, nodeNow) {
  const left = q && typeof q.until === "number" ? ` · ${duration(q.until - nodeNow)} left` : "";
  const why = q && q.reason === "false_reports" ? "false reports" : "wrong output";
  return el("span", {
    className: "badge bad",
    text: `quarantined: ${why}${left}`,
    title: q ? `offences ${q.offences}, false reports ${q.false_reports}, evidence ${q.evidence}` : null,
  });
}

function servesCell(record) {
  if (record.error) return el("td", { className: "bad", text: "record unreadable" });
  const a = record.assignment;
  const cap = record.capability;
  if (!a) {
    return el("td", { className: "muted", text: record.spare ? "nothing yet (spare capacity)" : "nothing" });
  }
  const total = cap && cap.num_layers ? ` of ${cap.num_layers}` : "";
  return el(
    "td",
    {},
    el("span", { className: "model-name", text: a.model }),
    el("span", { className: "muted", text: ` ${layersText(a.layers)}${total} · ${a.recipe} · ${a.tier}` }),
  );
}

function admissionCell(m, s, excluded) {
  if (m.self && s.admission) {
    const doctor = s.admission.doctor;
    const why = doctor && !doctor.admitted && (doctor.message || doctor.reason);
    return el("td", { className: admissionClass(s.admission.state), text: why ? `${s.admission.state}: ${why}` : s.admission.state });
  }
  const cap = (m.record || {}).capability;
  if (!cap) return el("td", { className: "muted", text: (m.record || {}).assignment ? "not checked yet" : "-" });
  let label = cap.result;
  if (cap.failure) label += `: ${cap.failure}`;
  if (excluded && cap.result === "admitted") label += ` (not routed: ${excluded})`;
  return el("td", { className: admissionClass(excluded && excluded !== "dead" ? "failed" : cap.result), text: label });
}

function admissionClass(state) {
  if (state === "admitted") return "good";
  if (state === "failed") return "bad";
  return "muted";
}

function speedCell(cap) {
  if (!cap || cap.result !== "admitted") return el("td", { className: "muted", text: "-" });
  return el("td", {
    text: `${rate(cap.decode_tokens_per_s)} tok/s decode`,
    title: `measured by the doctor: ${rate(cap.prefill_tokens_per_s)} tok/s prefill, ${rate(cap.decode_tokens_per_s)} tok/s decode`,
  });
}

function sessionsText(count) {
  return `${count} session${count === 1 ? "" : "s"} open`;
}

function loadCell(m, s) {
  if (!m.self) {
    // Another node's load is what its record last said (it republishes a
    // changed count every few seconds).
    const sessions = (m.record || {}).sessions;
    if (typeof sessions !== "number") return el("td", { className: "muted", text: "-" });
    return el("td", { text: sessionsText(sessions), title: "as the node last published it" });
  }
  const batching = s.hop && s.hop.batching;
  const batches = batching && batching.batches
    ? ` · ${batching.batches} batches of ${batching.mean_rows} rows on average (at most ${batching.largest})`
    : "";
  const steps = s.hop ? ` · ${s.hop.decode_steps} decode steps${batches}` : "";
  return el("td", { text: `${sessionsText(s.sessions)}${steps}` });
}

function renderEvents(s) {
  // Changes of state only (a "record" event is a node re-publishing its record).
  const events = (s.events || []).filter((e) => e.kind !== "record").slice(-EVENTS_SHOWN).reverse();
  $("events").replaceChildren(
    ...events.map((e) =>
      el("li", { className: `event ${e.kind}` }, el("span", { className: "event-kind", text: e.kind }), text(" "),
        nodeLabel(e.node_id), el("span", { className: "muted", text: ` ${ago(e.ago_s)}` })),
    ),
  );
}

async function pollStatus() {
  try {
    const response = await fetch("/v1/network/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`the status answered ${response.status}`);
    const failed = render(await response.json());
    $("offline").textContent = failed.length ? `part of the view failed: ${failed.join("; ")}` : "";
    $("offline").hidden = !failed.length;
    document.body.classList.remove("stale");
  } catch (err) {
    $("offline").textContent = `cannot read this node's status: ${err.message || err}`;
    $("offline").hidden = false;
    document.body.classList.add("stale");
  }
  setTimeout(pollStatus, STATUS_POLL_MS);
}

// --- the chat box ------------------------------------------------------------

const chat = { history: [], controller: null, models: [], modelsKey: null };

class ChatFailure extends Error {}

async function pollModels() {
  try {
    const response = await fetch("/v1/models", { cache: "no-store" });
    if (response.ok) fillModels((await response.json()).data || []);
  } catch {
    // The status poll reports an unreachable node.
  }
  setTimeout(pollModels, MODELS_POLL_MS);
}

function fillModels(models) {
  chat.models = models;
  const select = $("model");
  const key = JSON.stringify(models.map((m) => [m.id, m.status]));
  if (key !== chat.modelsKey) {
    // Rebuilt only when the list changed: an open picker stays open.
    chat.modelsKey = key;
    const chosen = select.value;
    select.replaceChildren(
      ...models.map((m) => {
        const option = el("option", { text: m.status === "ready" ? m.id : `${m.id} (loading)` });
        option.value = m.id;
        return option;
      }),
    );
    const ready = models.find((m) => m.status === "ready");
    if (models.some((m) => m.id === chosen)) select.value = chosen;
    else if (ready) select.value = ready.id;
  }
  const current = models.find((m) => m.id === select.value);
  let state = models.length ? "" : "no model in this swarm yet";
  if (current && current.status !== "ready") {
    state = `loading: ${spansText(current.gaps || [])} not served yet`;
  } else if (current && current.chat_template === false) {
    state = "this model has no chat template: it takes text completions only (POST /v1/completions)";
  }
  $("model-state").textContent = state;
}

function addMessage(role, content) {
  const body = el("div", { className: "text" });
  const textNode = text(content);
  body.append(textNode);
  const meta = el("div", { className: "meta muted" });
  const box = el("div", { className: `msg ${role}`, data: { state: role === "user" ? "sent" : "waiting" } },
    el("div", { className: "who", text: role === "user" ? "you" : "swarm" }), body, meta);
  $("transcript").append(box);
  scrollTranscript(true);
  return { box, textNode, meta };
}

function scrollTranscript(force = false) {
  const box = $("transcript");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
}

async function send(prompt) {
  const model = $("model").value;
  if (!model) {
    addMessage("assistant", "There is no model to chat with yet.").box.dataset.state = "error";
    return;
  }
  chat.history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const answer = addMessage("assistant", "");
  answer.box.dataset.model = model;
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  try {
    const result = await complete(model, chat.history.slice(), answer, controller.signal);
    answer.box.dataset.state = "done";
    describe(answer, result);
  } catch (err) {
    if (controller.signal.aborted) {
      answer.box.dataset.state = "stopped";
      answer.meta.textContent = "stopped";
    } else {
      answer.box.dataset.state = "error";
      answer.meta.textContent = err instanceof ChatFailure ? err.message : `error: ${err.message || err}`;
    }
  } finally {
    const said = answer.textNode.data;
    if (said) chat.history.push({ role: "assistant", content: said });
    else chat.history.pop(); // nothing came back: the question is not part of the chat
    chat.controller = null;
    hideWait();
    setBusy(false);
  }
}

function chatBody(model, messages) {
  return JSON.stringify({
    model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Math.max(1, Math.floor(Number($("max-tokens").value) || 256)),
    temperature: Math.max(0, Number($("temperature").value) || 0),
  });
}

/** Stream one answer into `answer`, waiting out `model_loading` (503) and
 * busy (429) answers for as long as the user lets it (Stop aborts). */
async function complete(model, messages, answer, signal) {
  for (let attempt = 1; ; attempt++) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: chatBody(model, messages),
      signal,
    });
    if (response.ok) {
      hideWait();
      return await readStream(response, answer);
    }
    const error = await errorOf(response);
    const loading = response.status === 503 && error.code === "model_loading";
    if (!loading && response.status !== 429) {
      throw new ChatFailure(error.message || `the node answered ${response.status}`);
    }
    const seconds = retryAfter(response);
    answer.box.dataset.state = "waiting";
    await waitToRetry(model, error, loading, seconds, attempt, signal);
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body && typeof body.error === "object" && body.error ? body.error : {};
  } catch {
    return {};
  }
}

function retryAfter(response) {
  const seconds = Number(response.headers.get("Retry-After"));
  if (!Number.isFinite(seconds) || seconds <= 0) return DEFAULT_RETRY_AFTER_S;
  return Math.min(seconds, MAX_RETRY_AFTER_S);
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new DOMException("stopped", "AbortError"));
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new DOMException("stopped", "AbortError"));
    }, { once: true });
  });
}

async function waitToRetry(model, error, loading, seconds, attempt, signal) {
  const wait = $("wait");
  wait.hidden = false;
  wait.dataset.attempt = String(attempt);
  wait.dataset.kind = loading ? "model_loading" : "busy";
  const coverage = loading && error.coverage && typeof error.coverage === "object" ? error.coverage : null;
  const strip = coverage && coverage.layers ? layerStrip(coveredFlags(coverage.layers, coverage.covered)) : null;
  $("wait-strip").replaceChildren(...(strip ? [strip] : []));
  const details = [];
  if (coverage) {
    const layers = coverage.layers ? ` of ${coverage.layers}` : "";
    details.push(`covered: ${spansText(coverage.covered || [])}${layers}`);
    details.push(`gaps: ${spansText(coverage.gaps || [])}`);
    if ((coverage.loading || []).length) details.push(`loading on ${coverage.loading.map(shortId).join(", ")}`);
    if (coverage.reason) details.push(`why: ${coverage.reason}`);
  } else if (error.message) {
    details.push(error.message);
  }
  $("wait-details").textContent = details.join(" · ");
  const what = loading ? `The swarm is still loading ${model}` : "This node is busy";
  const deadline = performance.now() + seconds * 1000;
  for (let left = deadline - performance.now(); left > 0; left = deadline - performance.now()) {
    $("wait-title").textContent =
      `${what}: retrying in ${Math.ceil(left / 1000)} s (attempt ${attempt + 1}; Stop gives up)`;
    await sleep(Math.min(1000, left), signal);
  }
  $("wait-title").textContent = `${what}: retrying now (attempt ${attempt + 1})`;
}

function hideWait() {
  $("wait").hidden = true;
}

/** Read the server-sent events of one completion into `answer`. */
async function readStream(response, answer) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const result = { finish: null, extension: null, usage: null, deltas: 0 };
  answer.box.dataset.state = "streaming";
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    for (;;) {
      const end = buffer.search(/\r?\n\r?\n/);
      if (end < 0) break;
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return result;
      onChunk(JSON.parse(data), answer, result);
    }
  }
  throw new ChatFailure("the stream ended before the answer was complete");
}

function onChunk(chunk, answer, result) {
  if (chunk.error) {
    throw new ChatFailure(`the swarm lost this answer: ${chunk.error.message || chunk.error.code || "error"}`);
  }
  const choice = (chunk.choices || [])[0];
  if (choice) {
    const piece = choice.delta && choice.delta.content;
    if (piece) {
      answer.textNode.appendData(piece);
      result.deltas++;
      answer.box.dataset.deltas = String(result.deltas);
      scrollTranscript();
    }
    if (choice.finish_reason) result.finish = choice.finish_reason;
  }
  if (chunk.shardmesh) result.extension = chunk.shardmesh;
  if (chunk.usage) result.usage = chunk.usage;
}

function describe(answer, result) {
  const parts = [];
  if (result.usage) parts.push(`${result.usage.completion_tokens} tokens`);
  if (result.finish === "length") parts.push("stopped at max tokens");
  const ext = result.extension;
  const timing = ext && ext.timing;
  if (timing && typeof timing.ttft_ms === "number") parts.push(`first token ${Math.round(timing.ttft_ms)} ms`);
  if (timing && typeof timing.decode_ms_per_token === "number") {
    parts.push(`${timing.decode_ms_per_token.toFixed(1)} ms/token`);
  }
  if (ext && ext.reroutes) parts.push(`${ext.reroutes} re-route${ext.reroutes === 1 ? "" : "s"}`);
  const route = ext && Array.isArray(ext.route) ? ext.route : [];
  answer.meta.replaceChildren(text(parts.join(" · ")));
  if (route.length) {
    answer.meta.append(text(`${parts.length ? " · " : ""}via ${route.length} node${route.length === 1 ? "" : "s"}: `));
    route.forEach((id, i) => answer.meta.append(...(i ? [text(" → ")] : []), nodeLabel(id)));
  }
}

function startChat() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = prompt.value.trim();
    if (!value || chat.controller) return;
    prompt.value = "";
    send(value);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    $("transcript").replaceChildren();
  });
  $("model").addEventListener("change", () => fillModels(chat.models));
}

startChat();
pollModels();
pollStatus();
