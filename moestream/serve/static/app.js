// moestream serve's page: a chat over /v1/chat/completions, and the expert
// stream drawn from /stats/stream (Server-Sent Events of the runtime's stats).
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 160; // samples each chart keeps
const MIN_WINDOW = 8; // the fewest samples a chart's width spans
const MIB = 1 << 20;

function human(n) {
  const units = [["T", 2 ** 40], ["G", 2 ** 30], ["M", 2 ** 20], ["K", 2 ** 10]];
  for (const [unit, size] of units) {
    if (n >= size) return (n / size).toFixed(1) + unit;
  }
  return n + "B";
}

// ---- chat ----

const chat = { messages: [], controller: null };

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  if (role === "assistant") {
    const meta = document.createElement("span");
    meta.className = "meta";
    div.append(meta);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function requestBody() {
  const messages = [...chat.messages];
  const system = $("system").value;
  if (system.trim()) messages.unshift({ role: "system", content: system });
  const body = {
    model: "default_model",
    messages,
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  return body;
}

async function errorText(response) {
  const text = await response.text();
  try {
    const parsed = JSON.parse(text);
    return `${response.status}: ${parsed.error?.message ?? parsed.error ?? text}`;
  } catch {
    return `${response.status}: ${text}`;
  }
}

// The SSE blocks of a streamed completion: each parsed `data:` object.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data && data !== "[DONE]") yield JSON.parse(data);
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("abort").disabled = !busy;
}

async function send(text) {
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const [body, meta] = div.children;
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const started = performance.now();
  let answer = "", chunks = 0, finish = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseData(response)) {
      if (chunk.error) throw new Error(chunk.error.message ?? String(chunk.error));
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.delta?.content) {
        answer += choice.delta.content;
        body.textContent = answer;
        chunks += 1;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const seconds = (performance.now() - started) / 1000;
    meta.textContent = `${chunks} chunks in ${seconds.toFixed(1)} s · ${finish}`;
  } catch (e) {
    if (e.name === "AbortError") {
      meta.textContent = "stopped";
    } else {
      div.classList.add("error");
      meta.textContent = e.message;
    }
  } finally {
    if (answer) chat.messages.push({ role: "assistant", content: answer });
    chat.controller = null;
    div.dataset.done = "1";
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("abort").addEventListener("click", () => chat.controller?.abort());
$("clear").addEventListener("click", () => {
  chat.controller?.abort();
  chat.messages = [];
  $("messages").replaceChildren();
});

// ---- live panel ----

const live = {
  last: null, times: [], hit: [], tps: [], disk: [], fill: [], layers: [], peakRss: 0,
};

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function setValue(id, text, raw) {
  const el = $(id);
  el.textContent = text;
  el.dataset.value = String(raw);
}

function fitCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [ctx, width, height];
}

// The first sample with tokens or routed experts: the charts' windows start there.
function firstActive() {
  let first = live.times.length;
  live.tps.forEach((v, i) => {
    if (i < first && ((v ?? 0) > 0 || live.hit[i] !== null)) first = i;
  });
  return Math.max(0, Math.min(first, live.times.length - MIN_WINDOW));
}

// Lines over the samples from `start` on, the newest at the right edge.
function drawChart(canvas, seriesList, colors, fixedMax, start) {
  const [ctx, w, h] = fitCanvas(canvas, 90);
  const shown = seriesList.map((s) => s.slice(start));
  const values = shown.flat().filter((v) => v !== null);
  const max = fixedMax ?? Math.max(1e-9, ...values) * 1.1;
  const span = Math.max(1, shown[0].length - 1); // the window: the samples shown
  const offset = shown[0].length === 1 ? 1 : 0;
  ctx.strokeStyle = "#2c3039";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  let firstX = null;
  shown.forEach((series, i) => {
    ctx.strokeStyle = colors[i];
    ctx.fillStyle = colors[i];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    series.forEach((v, x) => {
      if (v === null) { drawing = false; return; }
      const px = ((offset + x) / span) * w, py = h - 4 - (v / max) * (h - 8);
      if (firstX === null || px < firstX) firstX = px;
      if (drawing) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      drawing = true;
    });
    ctx.stroke();
  });
  ctx.fillStyle = "#8a8f99";
  ctx.font = "10px system-ui";
  ctx.fillText(fixedMax ? "100%" : max.toPrecision(3), 4, 11);
  canvas.dataset.samples = String(shown[0].length);
  canvas.dataset.firstX = firstX === null ? "" : firstX.toFixed(1);
  canvas.dataset.width = String(w);
}

function drawScales() {
  const stops = [0, 0.25, 0.5, 0.75, 1].map((v) => heat(Math.sqrt(v)));
  for (const ramp of document.querySelectorAll(".scale .ramp")) {
    ramp.style.background = `linear-gradient(to right, ${stops.join(", ")})`;
  }
}

function heat(v) {
  // 0 -> dark blue, 1 -> hot orange; v is already normalised
  const hue = 220 - 190 * v;
  return `hsl(${hue}, 75%, ${18 + 42 * v}%)`;
}

function layerHeat(layer) {
  const max = Math.max(1, ...layer.uses);
  return (e) => heat(Math.sqrt(layer.uses[e] / max));
}

function drawGrid(canvas, layers, columns, cell) {
  const rowH = Math.max(4, Math.min(16, Math.floor(320 / Math.max(1, layers.length))));
  const [ctx, w] = fitCanvas(canvas, rowH * layers.length + 2);
  const colW = (w - 40) / Math.max(1, columns);
  ctx.font = `${Math.min(10, rowH - 2)}px system-ui`;
  ctx.textBaseline = "middle";
  layers.forEach((layer, row) => {
    const y = row * rowH + 1;
    ctx.fillStyle = "#8a8f99";
    if (rowH >= 8) ctx.fillText("L" + layer.layer, 2, y + rowH / 2);
    cell(ctx, layer, (col) => [40 + col * colW, y, Math.max(1, colW - 1), rowH - 1]);
  });
  canvas.grid = { rowH, colW, layers };
}

function drawSlots(canvas, layers) {
  const columns = Math.max(0, ...layers.map((l) => l.capacity));
  drawGrid(canvas, layers, columns, (ctx, layer, box) => {
    const color = layerHeat(layer);
    for (let s = 0; s < layer.capacity; s++) {
      const [x, y, cw, ch] = box(s);
      const expert = layer.slots ? layer.slots[s] : -1;
      ctx.fillStyle = expert >= 0 ? color(expert) : "#2c3039";
      ctx.fillRect(x, y, cw, ch);
      if (expert >= 0 && cw >= 14 && ch >= 9) {
        ctx.fillStyle = "#e4e6eb";
        ctx.fillText(String(expert), x + 2, y + ch / 2);
      }
    }
  });
}

function drawExperts(canvas, layers) {
  const columns = Math.max(0, ...layers.map((l) => l.experts));
  drawGrid(canvas, layers, columns, (ctx, layer, box) => {
    const color = layerHeat(layer);
    const held = new Set(layer.slots ?? []);
    for (let e = 0; e < layer.experts; e++) {
      const [x, y, cw, ch] = box(e);
      ctx.fillStyle = color(e);
      ctx.fillRect(x, y, cw, ch);
      if (held.has(e)) {
        ctx.fillStyle = "#ffffff";
        const r = Math.max(1, Math.min(cw, ch) / 4);
        ctx.beginPath();
        ctx.arc(x + cw / 2, y + ch / 2, r, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  });
}

function hover(canvas, describe) {
  canvas.addEventListener("mousemove", (event) => {
    const g = canvas.grid;
    if (!g) return;
    const rect = canvas.getBoundingClientRect();
    const row = Math.floor((event.clientY - rect.top - 1) / g.rowH);
    const col = Math.floor((event.clientX - rect.left - 40) / g.colW);
    const layer = g.layers[row];
    $("hover").textContent = layer && col >= 0 ? describe(layer, col) : "\u00a0";
  });
}

hover($("slots"), (layer, s) => {
  if (s >= layer.capacity) return "\u00a0";
  const e = layer.slots ? layer.slots[s] : -1;
  return e >= 0
    ? `layer ${layer.layer}, slot ${s}: expert ${e}, used by ${layer.uses[e]} calls`
    : `layer ${layer.layer}, slot ${s}: ${layer.slots ? "free" : "not visible"}`;
});
hover($("experts"), (layer, e) => {
  if (e >= layer.experts) return "\u00a0";
  const slot = layer.slots ? layer.slots.indexOf(e) : -1;
  const where = slot >= 0 ? `in slot ${slot}` : "not in a slot";
  return `layer ${layer.layer}, expert ${e}: used by ${layer.uses[e]} calls, ${where}`;
});

function drawBar(el, parts, total, marker) {
  const spans = parts.map(([value, color, title]) => {
    const span = document.createElement("span");
    span.style.width = `${(100 * value) / Math.max(1, total)}%`;
    span.style.background = color;
    span.title = `${title}: ${human(value)}`;
    return span;
  });
  if (marker) {
    const line = document.createElement("i");
    line.style.left = `${Math.min(100, (100 * marker[0]) / Math.max(1, total))}%`;
    line.title = `${marker[1]}: ${human(marker[0])}`;
    spans.push(line);
  }
  el.replaceChildren(...spans);
}

// What the plan holds, in the order the budget is spent; the last: the
// prompt cache's bound (the part of it in use is drawn brighter).
function memoryParts(m) {
  const unused = Math.max(0, (m.prompt_cache_limit ?? 0) - m.prompt_cache);
  return [
    ["process", m.process, "#6b7280", "Python, MLX, tokenizer (rounded up)"],
    ["dense", m.dense, "#5fb3ff", "attention, norms, embeddings, routers"],
    ["KV", m.kv_cache, "#7bd88f", "KV cache, planned for the context"],
    ["activations", m.activations + m.staging, "#4fc1b0", "a prefill chunk, staging"],
    ["slots", m.experts, "#ffb454", "expert slots"],
    ["reserve", m.reserve, "#8f5b5b", "allocator slack"],
    ["prompt cache", m.prompt_cache, "#c792ea", "prompt cache in use"],
    ["prompt cache free", unused, "#4a3a5c", "prompt cache's room left"],
  ].filter(([, value]) => value > 0);
}

function showMemory(m) {
  // against the budget when there is one; the white line: resident memory now
  const total = m.budget || Math.max(m.planned, m.rss);
  const parts = memoryParts(m);
  drawBar($("memory-bar"), parts.map(([name, v, color, note]) => [v, color, `${name}: ${note}`]),
    total, [m.rss, "resident now"]);
  $("memory-keys").replaceChildren(...parts.map(([name, value, color, note]) => {
    const key = document.createElement("span");
    key.dataset.part = name;
    key.dataset.value = String(value);
    key.title = note;
    const box = document.createElement("b");
    box.style.background = color;
    key.append(box, `${name} ${human(value)}`);
    return key;
  }));
  live.peakRss = Math.max(live.peakRss, m.peak_rss, m.rss);
  const budget = m.budget ? `of budget ${human(m.budget)}` : "(no budget)";
  $("memory").textContent =
    `plan ${human(m.planned)} ${budget} · RSS ${human(m.rss)} (peak ${human(live.peakRss)}) · ` +
    `MLX ${human(m.mlx_active)} (peak ${human(m.mlx_peak)})`;
  $("memory").dataset.rss = String(m.rss);
  $("memory").dataset.peak = String(live.peakRss);
}

function showTier(tier) {
  if (!tier) {
    drawBar($("tier-bar"), [], 1);
    $("tier").textContent = "none (the page cache holds what was read)";
    return;
  }
  drawBar($("tier-bar"), [[tier.filled, "#7bd88f", "records held"]], tier.records);
  $("tier").textContent =
    `${tier.filled} of ${tier.records} records (${human(tier.filled * tier.record_bytes)} of ` +
    `${human(tier.records * tier.record_bytes)})`;
}

function showNote(s) {
  const notes = [];
  if (s.ranks > 1) {
    const layers = s.layers ?? [];
    const span = layers.length
      ? `layers ${layers[0].layer}–${layers[layers.length - 1].layer}`
      : "no MoE layer";
    notes.push(`Pipeline of ${s.ranks} ranks: this is rank ${s.rank} (${span}); its counters ` +
      "and slots are drawn, the other ranks' slots are not visible here.");
  }
  if (s.slots_visible === false) {
    notes.push("Slots are resolved on the device: which expert each holds is not visible.");
  }
  $("note").hidden = notes.length === 0;
  $("note").textContent = notes.join(" ");
}

function showNumbers(s) {
  const r = s.requests, x = s.experts;
  setValue("tokens-per-second", r.tokens_per_second.toFixed(1), r.tokens_per_second);
  setValue("active", `${r.active} / ${r.decode_concurrency}`, r.active);
  setValue("generation-tokens", String(r.generation_tokens), r.generation_tokens);
  if (!x) return;
  setValue("hit-rate", (100 * x.hit_rate).toFixed(1) + "%", x.hit_rate);
  $("hit-rate").dataset.hits = String(x.hits);
  $("hit-rate").dataset.misses = String(x.misses);
  setValue("bytes-read", human(x.bytes_read), x.bytes_read);
  setValue("fill-bytes", human(x.fill_bytes), x.fill_bytes);
  const tokens = Math.max(1, r.generation_tokens);
  setValue("mb-disk", (x.bytes_read / tokens / MIB).toFixed(2), x.bytes_read / tokens);
  setValue("mb-fill", (x.fill_bytes / tokens / MIB).toFixed(2), x.fill_bytes / tokens);
}

function addSamples(s, last) {
  const dt = s.time - last.time;
  const tokens = s.requests.generation_tokens - last.requests.generation_tokens;
  const x = s.experts, p = last.experts;
  const routed = x.hits + x.misses - p.hits - p.misses;
  push(live.times, s.time);
  push(live.hit, routed > 0 ? (x.hits - p.hits) / routed : null);
  push(live.tps, dt > 0 ? tokens / dt : null);
  push(live.disk, tokens > 0 ? (x.bytes_read - p.bytes_read) / tokens / MIB : null);
  push(live.fill, tokens > 0 ? (x.fill_bytes - p.fill_bytes) / tokens / MIB : null);
  const start = firstActive();
  drawChart($("chart-hit"), [live.hit], ["#5fb3ff"], 1, start);
  drawChart($("chart-tps"), [live.tps], ["#7bd88f"], undefined, start);
  drawChart($("chart-mb"), [live.disk, live.fill], ["#ffb454", "#c792ea"], undefined, start);
  const seconds = live.times[live.times.length - 1] - live.times[start];
  $("window").textContent =
    `charts: the last ${seconds.toFixed(1)} s, from the first sample with tokens (${HISTORY} samples at most)`;
  $("window").dataset.seconds = seconds.toFixed(2);
}

function showAbout(s) {
  const a = s.about;
  $("model").textContent = a?.name ?? s.model;
  $("model").dataset.name = a?.name ?? s.model;
  if (!a) return;
  const topK = a.top_k ? `, top-${a.top_k}` : "";
  const backend = s.backend ? ` · ${s.backend.describe}` : "";
  $("about").textContent =
    `${a.family} · ${a.moe_layers} MoE layers of ${a.experts} experts${topK} · served as "${s.model}"${backend}`;
}

function show(s) {
  showAbout(s);
  showNumbers(s);
  showNote(s);
  if (!s.experts) return;
  if (live.last?.experts) addSamples(s, live.last);
  live.last = s;
  live.layers = s.layers;
  drawSlots($("slots"), s.layers);
  drawExperts($("experts"), s.layers);
  showMemory(s.memory);
  showTier(s.host_tier);
  document.body.dataset.updated = String(s.time);
}

function connect() {
  const source = new EventSource("/stats/stream");
  source.onopen = () => {
    $("status").textContent = "live";
    $("status").classList.add("live");
  };
  source.onmessage = (event) => show(JSON.parse(event.data));
  source.onerror = () => {
    $("status").textContent = "reconnecting";
    $("status").classList.remove("live");
  };
}

drawScales();
connect();
