"use strict";
// The people page: the agent API of this server, read and written from the browser. Every text
// from the server goes into the page as text nodes, never as markup: history is user content,
// and Markdown in replies is rendered by building elements (markdown() below), never raw HTML.

const KEY = "semantic-api-key";  // sessionStorage: this tab only
const ROLES = ["user", "assistant", "system", "tool"];
const $ = (id) => document.getElementById(id);
const enc = encodeURIComponent;

class NeedKey extends Error {}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function when(iso) {
  return iso ? iso.replace("T", " ").slice(0, 19) : "";
}

function currentAgent() {
  return decodeURIComponent(location.hash.slice(1));
}

// A request to this server's API, with the key when one is set; the Response when it is ok.
async function request(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers["x-api-key"] = key;
  const options = { method, headers, signal };
  if (body !== undefined) {
    headers["content-type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (response.status === 401) {
    askForKey(Boolean(key));
    throw new NeedKey();
  }
  if (!response.ok) {
    const data = await response.json().catch(() => null);
    throw new Error((data && data.error && data.error.message) || `HTTP ${response.status}`);
  }
  return response;
}

async function api(path, body, method) {
  const response = await request(path, { method: method || (body === undefined ? "GET" : "POST"), body });
  return response.status === 204 ? null : response.json();
}

function report(error) {  // null clears; NeedKey leaves what askForKey said
  if (error instanceof NeedKey) return;
  $("error").hidden = !error;
  $("error").textContent = error ? error.message : "";
}

function askForKey(refused) {
  sessionStorage.removeItem(KEY);
  $("key-form").hidden = false;
  $("forget-key").hidden = true;
  report(refused ? new Error("That key was refused: enter it again.") : null);
  $("key").focus();
}

// Markdown, as elements: paragraphs, fenced code blocks, headings, lists, inline code, bold,
// italic and links (http and https only, opened with rel="noopener noreferrer"). Text goes in
// as text nodes: a <script> or <img> in a reply is shown as those characters, never made.
const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const INLINE = /`([^`\n]+)`|\*\*(.+?)\*\*|__(.+?)__|\*(\S(?:.*?\S)?)\*|(?<![\w])_(\S(?:.*?\S)?)_(?![\w])|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

function markdown(source) {
  const root = el("div", "markdown");
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {  // to its closing fence, or to the end (a reply still streaming)
      const code = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) code.push(lines[i]);
      i += 1;
      const pre = el("pre");
      const block = el("code", "", code.join("\n"));
      if (fence[2]) block.dataset.lang = fence[2];
      pre.append(block);
      root.append(pre);
    } else if (!line.trim()) {
      i += 1;
    } else if (HEADING.test(line)) {
      const [, hashes, text] = line.match(HEADING);
      const heading = el(`h${Math.min(6, hashes.length + 3)}`);
      inline(heading, text);
      root.append(heading);
      i += 1;
    } else if (ITEM.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      if (ordered) list.start = parseInt(line, 10) || 1;
      while (i < lines.length && ITEM.test(lines[i]) && /^\s*\d/.test(lines[i]) === ordered) {
        const item = el("li");
        inline(item, lines[i].replace(ITEM, ""));
        for (i += 1; i < lines.length && /^\s{2,}\S/.test(lines[i]) && !ITEM.test(lines[i]); i += 1) {
          item.append(" ");
          inline(item, lines[i].trim());
        }
        list.append(item);
      }
      root.append(list);
    } else {
      const paragraph = el("p");
      for (let first = true; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !ITEM.test(lines[i]) &&
           !HEADING.test(lines[i]); i += 1, first = false) {
        if (!first) paragraph.append(el("br"));
        inline(paragraph, lines[i]);
      }
      root.append(paragraph);
    }
  }
  return root;
}

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1] !== undefined) parent.append(el("code", "", m[1]));
    else if (m[2] !== undefined || m[3] !== undefined) parent.append(inline(el("strong"), m[2] ?? m[3]));
    else if (m[4] !== undefined || m[5] !== undefined) parent.append(inline(el("em"), m[4] ?? m[5]));
    else parent.append(link(m[6], m[7], m[0]));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
  return parent;
}

function link(label, href, written) {
  let url = null;
  try { url = new URL(href); } catch { /* not an absolute URL: shown as written */ }
  if (!url || (url.protocol !== "http:" && url.protocol !== "https:")) return document.createTextNode(written);
  const anchor = el("a", "", label);
  anchor.href = url.href;
  anchor.rel = "noopener noreferrer";
  anchor.target = "_blank";
  return anchor;
}

// Message content, whatever protocol stored it: a string, Anthropic blocks, OpenAI chat
// messages with tool_calls, Responses items.
// ``rich``: an assistant's text, shown as Markdown (as elements built here, never as HTML).
function renderContent(content, rich) {
  const box = el("div", "content");
  if (typeof content === "string") box.append(rich ? markdown(content) : el("div", "text", content));
  else if (Array.isArray(content)) content.forEach((part) => box.append(renderPart(part, rich)));
  else if (content && typeof content === "object") box.append(renderObject(content));
  else if (content !== null && content !== undefined) box.append(el("div", "text", JSON.stringify(content)));
  return box;
}

function renderPart(part, rich) {
  if (typeof part === "string") return rich ? markdown(part) : el("div", "text", part);
  switch (part && part.type) {
    case "text": case "input_text": case "output_text": return rich ? markdown(part.text) : el("div", "text", part.text);
    case "tool_use": return toolCall(part.name, part.input, part.id);
    case "tool_result": return toolResult(part.tool_use_id, part.content);
    case "thinking": return labelled("thinking", el("div", "text", part.thinking));
    default: return labelled(String(part && part.type), el("pre", "", JSON.stringify(part, null, 2)));
  }
}

function renderObject(item) {
  if (item.tool_calls || item.tool_call_id) {  // an OpenAI chat message
    const box = el("div");
    if (item.tool_call_id) box.append(toolResult(item.tool_call_id, item.content));
    else if (item.content) box.append(renderContent(item.content));
    (item.tool_calls || []).forEach((call) => box.append(toolCall(call.function.name, call.function.arguments, call.id)));
    return box;
  }
  switch (item.type) {
    case "message": return renderContent(item.content, item.role === "assistant");
    case "function_call": return toolCall(item.name, item.arguments, item.call_id);
    case "function_call_output": return toolResult(item.call_id, item.output);
    default: return labelled(String(item.type), el("pre", "", JSON.stringify(item, null, 2)));
  }
}

function labelled(label, body) {
  const box = el("div", "part");
  box.append(el("div", "label", label), body);
  return box;
}

function toolCall(name, input, id) {
  let args = input;
  if (typeof args === "string") {
    try { args = JSON.parse(args); } catch { /* shown as it came */ }
  }
  const text = typeof args === "string" ? args : JSON.stringify(args, null, 2);
  return labelled(`tool call: ${name}${id ? ` (${id})` : ""}`, el("pre", "", text));
}

function toolResult(id, content) {
  return labelled(`tool result${id ? ` for ${id}` : ""}`, renderContent(content));
}

function renderMessage(message) {
  const role = ROLES.includes(message.role) ? message.role : "other";
  const box = el("div", `message ${role}`);
  box.append(el("div", "role", `${message.role} · ${when(message.created_at)}`),
    renderContent(message.content, message.role === "assistant"));
  return box;
}

function cacheTable(caches) {
  if (!caches.length) return el("p", "muted", "No cache.");
  const table = el("table", "caches");
  const head = el("tr");
  ["model", "tier", "cached tokens"].forEach((h) => head.append(el("th", "", h)));
  table.append(head);
  caches.forEach((cache) => {
    const row = el("tr");
    const model = el("td", "", cache.model || `${cache.model_fingerprint.slice(0, 16)} (a model not read since start)`);
    model.title = `fingerprint ${cache.model_fingerprint}`;
    row.append(model, el("td", cache.tier, cache.tier), el("td", "num", cache.cached_tokens));
    table.append(row);
  });
  return table;
}

function renderConversation(conversation, messages, latest) {
  const box = el("details", "conversation");
  box.open = latest;
  box.dataset.id = conversation.id;
  box.append(el("summary", "", `${conversation.id} · ${conversation.n_messages} messages · ${conversation.tier}` +
    ` · last access ${when(conversation.last_access_at)}${latest ? " · the box below continues this one" : ""}`));
  const hit = conversation.last_hit;
  box.append(cacheTable(conversation.caches), el("p", "muted", hit
    ? `Last read from cache: ${when(hit.at)}, ${hit.cached_tokens} of ${hit.input_tokens} prompt tokens.`
    : "No request has read from cache yet."));
  if (!messages.length) box.append(el("p", "muted", "No messages yet."));
  messages.forEach((message) => box.append(renderMessage(message)));
  return box;
}

async function showList() {
  const list = await api("/v1/agents?limit=200");
  const rows = list.data.map((agent) => {
    const row = el("tr", agent.id === currentAgent() ? "current" : "");
    const link = el("a", "", agent.id);
    link.href = `#${enc(agent.id)}`;
    const name = el("td");
    name.append(link, el("div", "origin muted", agent.origin));
    const last = el("td", "when");
    last.append(...when(agent.last_access_at).split(" ").map((part) => el("span", "", part)));
    row.append(name, el("td", agent.tier, agent.tier), el("td", "num", agent.n_messages), last);
    return row;
  });
  $("agents").tBodies[0].replaceChildren(...rows);
  $("no-agents").hidden = rows.length > 0;
  $("forget-key").hidden = !sessionStorage.getItem(KEY);
}

// The models a turn may name (GET /v1/models), the default one chosen; read once.
async function showModels() {
  if ($("model").options.length) return;
  const models = await api("/v1/models");
  const options = models.data.map((model) => {
    const option = el("option", "", `${model.id}${model.alias_of ? ` (${model.alias_of})` : ""}` +
      `${model.loaded ? " · loaded" : ""}`);
    option.value = model.id;
    option.selected = model.default;
    return option;
  });
  $("model").replaceChildren(...options);
}

async function showAgent(id) {
  const [agent, history] = await Promise.all([api(`/v1/agents/${enc(id)}`), api(`/v1/agents/${enc(id)}/history`)]);
  $("agent-title").textContent = agent.id;
  $("agent-facts").textContent = [`origin ${agent.origin}`, `tier ${agent.tier}`, `${agent.n_messages} messages`,
    `created ${when(agent.created_at)}`, agent.parent_id ? `forked from ${agent.parent_id}` : "",
    agent.metadata.system_prompt ? `system prompt: ${agent.metadata.system_prompt}` : ""]
    .filter(Boolean).join(" · ");
  const byConversation = new Map();
  history.messages.forEach((m) => byConversation.set(m.conversation_id,
    [...(byConversation.get(m.conversation_id) || []), m]));
  $("conversations").replaceChildren(...agent.conversations.map((c, i) =>
    renderConversation(c, byConversation.get(c.id) || [], i === 0)));
  if (!agent.conversations.length) $("conversations").append(el("p", "muted", "No conversations yet."));
  $("agent").hidden = false;
  sendLabel();
}

function sendLabel() {
  $("send-label").textContent = $("new-conversation").checked ? "Start a new conversation of this agent"
    : "Continue its most recent conversation";
}

async function route() {
  report(null);
  sendError(null);
  disarm();
  $("reply").hidden = true;
  try {
    await showList();
    await showModels();
    if (currentAgent()) await showAgent(currentAgent());
    else $("agent").hidden = true;
  } catch (error) {
    report(error);
  }
}

function sendError(error) {  // the error of a turn, next to the box that sent it
  if (error instanceof NeedKey) return;
  $("send-error").hidden = !error;
  $("send-error").textContent = error ? error.message : "";
}

function showUsage(usage, stopReason) {
  const prompt = (usage.input_tokens || 0) + (usage.cache_read_input_tokens || 0) +
    (usage.cache_creation_input_tokens || 0);
  const read = el("b", "", usage.cache_read_input_tokens || 0);
  read.id = "cache-read-tokens";
  $("cache-read").replaceChildren("read from cache: ", read, ` of ${prompt} tokens`,
    ` · ${usage.output_tokens || 0} generated · stop: ${stopReason}`);
}

// The frames of a server-sent event stream: [event, data parsed from JSON]; comments skipped.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      frame.split("\n").forEach((line) => {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      });
      if (data.length) yield [name, JSON.parse(data.join("\n"))];
    }
  }
}

let generation = null;  // the AbortController of the turn being streamed

function busy(on) {
  $("send-button").disabled = on;
  $("stop-button").hidden = !on;
  $("sending").hidden = !on;
}

// A turn, streamed: the reply grows as its text arrives; Stop aborts the request, and the
// server cancels the generation (it is recorded as cancelled, and no turn is stored).
async function send(event) {
  event.preventDefault();
  const id = currentAgent();
  const body = { messages: [{ role: "user", content: $("message").value }], stream: true,
    max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value) };
  if ($("model").value) body.model = $("model").value;
  if ($("new-conversation").checked) body.new_conversation = true;
  generation = new AbortController();
  busy(true);
  report(null);
  sendError(null);
  $("reply-body").replaceChildren();
  $("cache-read").replaceChildren();
  $("reply").hidden = false;
  let text = "";
  let usage = {};
  let stopReason = null;
  let finished = false;
  try {
    const response = await request(`/v1/agents/${enc(id)}/generate`, { method: "POST", body,
      signal: generation.signal });
    for await (const [name, data] of events(response)) {
      if (name === "message_start") usage = data.message.usage;
      else if (name === "content_block_delta" && data.delta.type === "text_delta") {
        text += data.delta.text;
        $("reply-body").replaceChildren(markdown(text));
      } else if (name === "message_delta") {
        usage = { ...usage, ...data.usage };
        stopReason = data.delta.stop_reason;
      } else if (name === "error") throw new Error(data.error.message);
    }
    finished = stopReason !== null;
    if (!finished) throw new Error("the stream ended before the reply did");
    $("message").value = "";
    $("new-conversation").checked = false;
  } catch (error) {
    if (error.name === "AbortError") {
      $("cache-read").textContent = "Stopped: the server cancelled the generation; the turn was not stored.";
    } else {
      $("reply").hidden = !text;
      sendError(error);
    }
  } finally {
    busy(false);
    generation = null;
  }
  try {
    await showAgent(id);  // the new turn and the caches, as stored
    await showList();
  } catch (error) {
    report(error);
  }
  if (finished) {
    showUsage(usage, stopReason);
    $("reply").scrollIntoView({ block: "nearest" });
  }
}

async function createAgent(event) {
  event.preventDefault();
  const body = {};
  if ($("new-id").value.trim()) body.id = $("new-id").value.trim();
  if ($("new-system").value.trim()) body.system_prompt = $("new-system").value;
  $("create-button").disabled = true;
  report(null);
  try {
    const agent = await api("/v1/agents", body);
    $("new-id").value = "";
    $("new-system").value = "";
    if (currentAgent() === agent.id) await route();
    else location.hash = enc(agent.id);  // hashchange: route()
    $("message").focus();
  } catch (error) {
    report(error);
  } finally {
    $("create-button").disabled = false;
  }
}

// Deleting takes two clicks: the first arms the button for five seconds.
let armed = null;

function disarm() {
  clearTimeout(armed);
  armed = null;
  $("delete-agent").classList.remove("armed");
  $("delete-agent").textContent = "Delete agent";
}

async function deleteAgent() {
  if (!armed) {
    $("delete-agent").classList.add("armed");
    $("delete-agent").textContent = "Delete its history and caches? Click again";
    armed = setTimeout(disarm, 5000);
    return;
  }
  disarm();
  const id = currentAgent();
  try {
    await api(`/v1/agents/${enc(id)}`, undefined, "DELETE");
    history.replaceState(null, "", location.pathname);
    await route();
  } catch (error) {
    report(error);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("send").addEventListener("submit", send);
  $("stop-button").addEventListener("click", () => generation && generation.abort());
  $("new-agent").addEventListener("submit", createAgent);
  $("delete-agent").addEventListener("click", deleteAgent);
  $("new-conversation").addEventListener("change", sendLabel);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value);
    $("key").value = "";
    $("key-form").hidden = true;
    route();
  });
  $("forget-key").addEventListener("click", (event) => {
    event.preventDefault();
    sessionStorage.removeItem(KEY);
    $("model").replaceChildren();
    route();
  });
  window.addEventListener("hashchange", route);
  route();
});
