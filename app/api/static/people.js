"use strict";
// The people page: the agent API of this server, read from the browser. Every text from the
// server goes into the page through textContent, never innerHTML: history is user content.

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

async function api(path, body) {
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers["x-api-key"] = key;
  const options = { headers };
  if (body !== undefined) {
    options.method = "POST";
    headers["content-type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (response.status === 401) {
    askForKey(Boolean(key));
    throw new NeedKey();
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new Error((data && data.error && data.error.message) || `HTTP ${response.status}`);
  return data;
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

// Message content, whatever protocol stored it: a string, Anthropic blocks, OpenAI chat
// messages with tool_calls, Responses items.
function renderContent(content) {
  const box = el("div", "content");
  if (typeof content === "string") box.append(el("div", "text", content));
  else if (Array.isArray(content)) content.forEach((part) => box.append(renderPart(part)));
  else if (content && typeof content === "object") box.append(renderObject(content));
  else if (content !== null && content !== undefined) box.append(el("div", "text", JSON.stringify(content)));
  return box;
}

function renderPart(part) {
  if (typeof part === "string") return el("div", "text", part);
  switch (part && part.type) {
    case "text": case "input_text": case "output_text": return el("div", "text", part.text);
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
    case "message": return renderContent(item.content);
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
  box.append(el("div", "role", `${message.role} · ${when(message.created_at)}`), renderContent(message.content));
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
    row.append(el("td", "", cache.model_fingerprint.slice(0, 16)), el("td", cache.tier, cache.tier),
      el("td", "num", cache.cached_tokens));
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
    name.append(link);
    row.append(name, el("td", "", agent.origin), el("td", agent.tier, agent.tier), el("td", "num", agent.n_messages),
      el("td", "", when(agent.last_access_at)));
    return row;
  });
  $("agents").tBodies[0].replaceChildren(...rows);
  $("no-agents").hidden = rows.length > 0;
  $("forget-key").hidden = !sessionStorage.getItem(KEY);
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
  $("agent").hidden = false;
}

async function route() {
  report(null);
  $("reply").hidden = true;
  try {
    await showList();
    if (currentAgent()) await showAgent(currentAgent());
    else $("agent").hidden = true;
  } catch (error) {
    report(error);
  }
}

function showReply(reply) {
  const u = reply.usage;
  const prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens;
  $("reply-body").replaceChildren(renderContent(reply.content));
  const read = el("b", "", u.cache_read_input_tokens);
  read.id = "cache-read-tokens";
  $("cache-read").replaceChildren("read from cache: ", read, ` of ${prompt} tokens`,
    ` · ${u.output_tokens} generated · stop: ${reply.stop_reason}`);
  $("reply").hidden = false;
  $("reply").scrollIntoView({ block: "nearest" });
}

async function send(event) {
  event.preventDefault();
  const id = currentAgent();
  const body = { messages: [{ role: "user", content: $("message").value }],
    max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value) };
  $("send-button").disabled = true;
  $("sending").hidden = false;
  report(null);
  try {
    const reply = await api(`/v1/agents/${enc(id)}/generate`, body);
    $("message").value = "";
    await showAgent(id);  // the new turn and the caches, as stored
    await showList();
    showReply(reply);
  } catch (error) {
    report(error);
  } finally {
    $("send-button").disabled = false;
    $("sending").hidden = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("send").addEventListener("submit", send);
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
    route();
  });
  window.addEventListener("hashchange", route);
  route();
});
