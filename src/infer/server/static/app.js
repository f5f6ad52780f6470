// infer's playground: streams a completion or chat answer from this server and colours every token by how the
// speculative round produced it (stream_options.include_spec, an extension OpenAI clients ignore).
const $ = (id) => document.getElementById(id);
const KEY = "infer-api-key"; // kept in sessionStorage only: gone with the tab
let controller = null;
let modelName = null;

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return `${resp.status}: ${body.error?.message ?? JSON.stringify(body)}`;
  } catch {
    return `${resp.status} ${resp.statusText}`;
  }
}

async function loadModel() {
  const resp = await fetch("/v1/models", { headers: headers() });
  if (!resp.ok) {
    showError(await errorMessage(resp));
    return null;
  }
  modelName = (await resp.json()).data[0].id;
  $("model").textContent = modelName;
  showError("");
  return modelName;
}

function requestBody(speculation) {
  const num = (id) => Number($(id).value);
  const body = {
    model: modelName, stream: true, speculation,
    stream_options: { include_usage: true, include_spec: true },
    temperature: num("temperature"), top_p: num("top_p"), top_k: Math.trunc(num("top_k")),
    max_tokens: Math.trunc(num("max_tokens")),
  };
  if ($("seed").value !== "") body.seed = Math.trunc(num("seed"));
  // penalties and stop strings go only when set: a request without them is what the server's defaults serve
  for (const [id, off] of [["presence_penalty", 0], ["frequency_penalty", 0], ["repetition_penalty", 1]]) {
    if ($(id).value !== "" && num(id) !== off) body[id] = num(id);
  }
  const stops = $("stop_strings").value.split("\n").filter((s) => s !== "")
    .map((s) => s.replace(/\\([nt\\])/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]));
  if (stops.length) body.stop = stops;
  const schema = $("schema").value.trim();
  if (schema) {
    // a schema that is not JSON is named here; one the grammar library refuses comes back as the server's 400
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error(`the JSON schema is not valid JSON: ${e.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
  }
  const prompt = $("prompt").value;
  if ($("mode").value === "chat") body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return body;
}

// One streamed generation; resolves to {tokens, seconds, acceptance} (null when stopped or failed).
async function run(speculation) {
  if (!modelName && !(await loadModel())) return null;
  const chat = $("mode").value === "chat";
  const out = $("output");
  out.replaceChildren();
  showError("");
  for (const [id, text] of [["tps", "-"], ["ntok", "0"], ["acc", "-"], ["ks", "-"]]) $(id).textContent = text;
  let tokens = 0, drafted = 0, accepted = 0;
  const ks = [];
  const t0 = performance.now();
  controller = new AbortController();
  $("send").disabled = $("compare").disabled = true;
  $("stop").disabled = false;
  try {
    let body;
    try { body = requestBody(speculation); } catch (e) { showError(e.message); return null; }
    const resp = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      showError(await errorMessage(resp));
      return null;
    }
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) {
          showError(event.error.message);
          continue;
        }
        for (const choice of event.choices ?? []) {
          const text = chat ? (choice.delta?.content ?? "") : (choice.text ?? "");
          const spec = choice.spec?.tokens ?? [];
          for (const t of spec) {
            tokens += 1;
            if (t.source === "accepted") accepted += 1;
            if (t.source === "recovered" || t.source === "bonus") { drafted += t.k; ks.push(t.k); }
          }
          if (text) {
            const span = document.createElement("span");
            span.className = `tok ${spec.length ? spec[spec.length - 1].source : "target"}`;
            span.textContent = text;
            out.append(span);
          }
        }
        const seconds = (performance.now() - t0) / 1000;
        $("tps").textContent = (tokens / seconds).toFixed(1);
        $("ntok").textContent = tokens;
        $("acc").textContent = drafted ? `${((100 * accepted) / drafted).toFixed(0)}%` : "-";
        $("ks").textContent = ks.length ? ks.slice(-12).join(" ") : "-";
      }
    }
    return { tokens, seconds: (performance.now() - t0) / 1000, acceptance: drafted ? accepted / drafted : null };
  } catch (e) {
    if (e.name !== "AbortError") showError(String(e));
    return null;
  } finally {
    controller = null;
    $("send").disabled = $("compare").disabled = false;
    $("stop").disabled = true;
  }
}

async function compare() {
  const rows = [];
  for (const speculation of [true, false]) {
    const r = await run(speculation);
    if (!r) return;
    rows.push([speculation ? "with speculation" : "without", r]);
  }
  const body = $("comparison").querySelector("tbody");
  body.replaceChildren(...rows.map(([name, r]) => {
    const tr = document.createElement("tr");
    for (const cell of [name, r.tokens, r.seconds.toFixed(2), (r.tokens / r.seconds).toFixed(1),
                        r.acceptance === null ? "-" : `${(100 * r.acceptance).toFixed(0)}%`]) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
  $("comparison").hidden = false;
}

$("key").value = sessionStorage.getItem(KEY) ?? "";
$("key").addEventListener("change", () => {
  sessionStorage.setItem(KEY, $("key").value.trim());
  loadModel();
});
$("send").addEventListener("click", () => run($("speculation").checked));
$("stop").addEventListener("click", () => controller?.abort());
$("compare").addEventListener("click", compare);
loadModel();
