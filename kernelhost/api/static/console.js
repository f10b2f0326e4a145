// kernelhost console: a notebook-style page over the /v1 API. Plain JavaScript, no build step.
// Everything a sandbox sends is untrusted: text goes in through textContent, HTML results render
// in a sandboxed iframe (no scripts, no access to this page or its stored key).
"use strict";

const state = { key: "", tabs: new Map(), active: null };
const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) node.append(child);
  return node;
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function api(method, path, body) {
  const resp = await fetch(path, {
    method,
    headers: { Authorization: "Bearer " + state.key, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (resp.status === 204) return null;
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error((data.error && data.error.message) || resp.statusText);
  return data;
}

// -- connecting, creating, opening -------------------------------------------------------------

async function connect(key) {
  state.key = key.trim();
  if (!state.key) return status("enter an API key", true);
  try {
    const health = await fetch("/healthz").then((r) => r.json());
    $("template").replaceChildren(...health.templates.map((t) => el("option", { value: t, textContent: t })));
    await refreshList();
    sessionStorage.setItem("kernelhost-key", state.key);
    status(`connected (${health.accel})`);
  } catch (err) {
    status("cannot connect: " + err.message, true);
  }
}

async function refreshList() {
  const { sandboxes } = await api("GET", "/v1/sandboxes");
  $("existing").replaceChildren(
    el("option", { value: "", textContent: `your sandboxes (${sandboxes.length})…` }),
    ...sandboxes.map((s) => el("option", { value: s.id, textContent: `${s.id} · ${s.template} · ${s.state}` })));
}

async function createSandbox(template) {
  status(`creating a ${template} sandbox…`);
  try {
    const sbx = await api("POST", "/v1/sandboxes", { template });
    openTab(sbx);
    status(`created ${sbx.id}`);
    await refreshList();
  } catch (err) {
    status("create failed: " + err.message, true);
  }
}

async function openSandbox(id) {
  if (!id) return;
  try {
    openTab(await api("GET", "/v1/sandboxes/" + id));
  } catch (err) {
    status(err.message, true);
  }
}

// -- tabs ----------------------------------------------------------------------------------------

function openTab(sbx, note = "") {
  if (state.tabs.has(sbx.id)) return activate(sbx.id);
  const cells = el("div", { className: "cells" });
  const panel = el("section", { className: "panel" });
  panel.dataset.sandbox = sbx.id;
  const fork = el("button", { textContent: "Fork into new tab", className: "fork" });
  const remove = el("button", { textContent: "Delete sandbox", className: "delete" });
  const add = el("button", { textContent: "+ cell", className: "add" });
  panel.append(el("div", { className: "toolbar" },
    el("span", { textContent: `${sbx.id} · ${sbx.template}${note}` }), fork, remove), cells, add);
  const tabButton = el("button", { textContent: sbx.id.slice(0, 12) + " · " + sbx.template });
  tabButton.onclick = () => activate(sbx.id);
  const tab = { sbx, panel, cells, button: tabButton };
  state.tabs.set(sbx.id, tab);
  fork.onclick = () => forkSandbox(tab);
  remove.onclick = () => deleteSandbox(tab, remove);
  add.onclick = () => addCell(tab).querySelector("textarea").focus();
  $("tabs").append(tabButton);
  document.querySelector("#panels .hint")?.remove();
  $("panels").append(panel);
  addCell(tab);
  activate(sbx.id);
}

function activate(id) {
  state.active = id;
  for (const [tabId, tab] of state.tabs) {
    tab.panel.hidden = tabId !== id;
    tab.button.classList.toggle("active", tabId === id);
  }
}

async function forkSandbox(tab) {
  status(`forking ${tab.sbx.id}…`);
  try {
    const { sandboxes } = await api("POST", `/v1/sandboxes/${tab.sbx.id}/fork`, { n: 1 });
    for (const child of sandboxes) openTab(child, ` (fork of ${tab.sbx.id})`);
    status(`forked ${tab.sbx.id}`);
    await refreshList();
  } catch (err) {
    status("fork failed: " + err.message, true);
  }
}

async function deleteSandbox(tab, button) {
  button.disabled = true;
  try {
    await api("DELETE", "/v1/sandboxes/" + tab.sbx.id);
  } catch (err) {
    button.disabled = false;
    return status(err.message, true);
  }
  tab.panel.remove();
  tab.button.remove();
  state.tabs.delete(tab.sbx.id);
  const next = state.tabs.keys().next();
  if (!next.done) activate(next.value);
  status(`deleted ${tab.sbx.id}`);
  await refreshList();
}

// -- cells ---------------------------------------------------------------------------------------

function addCell(tab) {
  const input = el("textarea", { className: "cell-input", spellcheck: false, placeholder: "code; Shift+Enter runs" });
  const run = el("button", { textContent: "Run", className: "run" });
  const output = el("div", { className: "cell-output" });
  const prompt = el("span", { className: "prompt", textContent: "[ ]" });
  const cell = el("div", { className: "cell" }, el("div", { className: "row" }, prompt, input, run), output);
  const go = () => runCell(tab, cell, input, output, prompt);
  run.onclick = go;
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && ev.shiftKey) {
      ev.preventDefault();
      go();
      if (cell === tab.cells.lastElementChild) addCell(tab).querySelector("textarea").focus();
    }
  });
  tab.cells.append(cell);
  return cell;
}

const ANSI = /\x1b\[[0-9;]*[A-Za-z]/g;

function render(output, event) {
  const last = output.lastElementChild;
  switch (event.type) {
    case "stdout":
    case "stderr":
      if (last && last.tagName === "PRE" && last.classList.contains(event.type)) last.textContent += event.text;
      else output.append(el("pre", { className: event.type, textContent: event.text }));
      break;
    case "result": {
      const node = renderResult(event.data || {});
      if (event.display_id != null) node.dataset.displayId = String(event.display_id);
      output.append(node);
      break;
    }
    case "update_display":  // a new version of a display: replaced where it is shown
      for (const old of output.querySelectorAll("[data-display-id]")) {
        if (old.dataset.displayId !== String(event.display_id)) continue;
        const node = renderResult(event.data || {});
        node.dataset.displayId = old.dataset.displayId;
        old.replaceWith(node);
      }
      break;
    case "error":
      output.append(el("pre", { className: "error",
        textContent: (event.traceback && event.traceback.length ? event.traceback.join("\n") : `${event.name}: ${event.value}`).replace(ANSI, "") }));
      break;
    case "clear_output":
      output.replaceChildren();
      break;
  }
}

function renderResult(data) {
  if (data["image/png"]) return el("img", { src: "data:image/png;base64," + data["image/png"], alt: "image/png result" });
  if (data["image/jpeg"]) return el("img", { src: "data:image/jpeg;base64," + data["image/jpeg"], alt: "image/jpeg result" });
  if (data["image/svg+xml"]) return el("img", { src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(data["image/svg+xml"]), alt: "svg result" });
  if (data["text/html"]) {
    const frame = el("iframe", { srcdoc: data["text/html"], title: "html result" });
    frame.setAttribute("sandbox", "");  // no scripts, an opaque origin
    return frame;
  }
  const text = data["text/plain"] ?? JSON.stringify(data["application/json"] ?? Object.keys(data));
  return el("pre", { className: "result", textContent: text });
}

async function runCell(tab, cell, input, output, prompt) {
  output.replaceChildren();
  prompt.textContent = "[*]";
  cell.dataset.status = "running";
  let end = null;
  try {
    const resp = await fetch(`/v1/sandboxes/${tab.sbx.id}/execute`, {
      method: "POST",
      headers: { Authorization: "Bearer " + state.key, "Content-Type": "application/json" },
      body: JSON.stringify({ code: input.value }),
    });
    if (!resp.ok) {
      const data = await resp.json().catch(() => ({}));
      throw new Error((data.error && data.error.message) || resp.statusText);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (!line) continue;
        const event = JSON.parse(line);
        if (event.type === "end") end = event;
        else render(output, event);
      }
    }
  } catch (err) {
    output.append(el("pre", { className: "error", textContent: "kernelhost: " + err.message }));
  }
  const ok = end && end.status === "ok";
  prompt.textContent = end && end.execution_count ? `[${end.execution_count}]` : "[ ]";
  cell.dataset.status = end ? end.status : "failed";
  const summary = !end ? "the stream ended early"
    : `${end.status}${end.recovery ? " (" + end.recovery + ")" : ""} · ${Math.round(end.duration_ms || 0)} ms`;
  output.append(el("div", { className: "end" + (ok ? "" : " failed"), textContent: summary }));
}

// -- start-up ------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("connect").onsubmit = (ev) => { ev.preventDefault(); connect($("key").value); };
  $("create").onsubmit = (ev) => { ev.preventDefault(); createSandbox($("template").value); };
  $("open").onsubmit = (ev) => { ev.preventDefault(); openSandbox($("existing").value); };
  // a key in the fragment (#key=...) never reaches the server; it is removed from the address bar.
  // A link must not swap the key silently (whoever sent it would see what is typed next): a key
  // other than the stored one is only offered, and used once the user presses Connect.
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromHash) history.replaceState(null, "", location.pathname);
  const stored = sessionStorage.getItem("kernelhost-key");
  if (fromHash && stored && fromHash.trim() !== stored) {
    $("key").value = fromHash;
    status(`this link carries a different API key (ending ${fromHash.trim().slice(-4)}); ` +
      "press Connect to switch to it, or reload to keep yours", true);
    return;
  }
  const key = fromHash || stored;
  if (key) {
    $("key").value = key;
    connect(key);
  }
});
