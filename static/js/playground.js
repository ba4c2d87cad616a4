/* The playground: a chat over the WebSocket API (/v1/ws) with the dashboard's session cookie.
 *
 * Frames out: {"request_id", "endpoint": "chat.completions", model, messages, stream, ...} and
 * {"type": "cancel", "request_id"}. Frames in: OpenAI chunks carrying our request_id, then
 * {"type": "done"}; or {"type": "error", "error": {...}}. Costs are exact: micro-dollars as BigInt.
 */
(function () {
  "use strict";
  // ---- money: "0.000123" <-> 123n micro-dollars -------------------------------------------------
  function micros(text) {
    const [whole, frac = ""] = String(text).split(".");
    return BigInt(whole || "0") * 1000000n + BigInt((frac + "000000").slice(0, 6));
  }
  // As the usd_exact template filter writes it: below a cent, all six decimals, so that small costs
  // line up; zero and from a cent, trailing zeros trimmed past the cents.
  function formatUsd(value) {
    const negative = value < 0n;
    if (negative) value = -value;
    const whole = value / 1000000n;
    let frac = (value % 1000000n).toString().padStart(6, "0");
    if (value === 0n || value >= 10000n) frac = frac.replace(/0+$/, "").padEnd(2, "0");
    return (negative ? "-$" : "$") + whole.toLocaleString("en-US") + "." + frac;
  }
  window.PlaygroundMoney = { micros, formatUsd };  // for tests/dashboard/test_money.py, run in Node

  const root = document.getElementById("playground");
  if (!root) return;
  const $ = (id) => document.getElementById(id);
  const pane = $("messages"), input = $("chat-input"), sendButton = $("send-button"), stopButton = $("stop-button");
  const select = $("deployment-select"), conn = $("conn-state");
  // The socket's URL names the organization the page was rendered for (?organization=): the server
  // bills that one, or refuses when the user no longer belongs to it, even after the user switches
  // organization in another tab; a reply's cost is looked up there too.
  const wsUrl = root.dataset.wsUrl, costUrl = root.dataset.costUrl;
  const organizationId = root.dataset.organization;
  const emptyState = $("chat-empty");

  let socket = null;
  let refusal = null;      // why the server refused the connection (its error frame), shown as it closes
  let history = [];        // [{role, content}] of finished turns
  let current = null;      // the reply being streamed into the chat on screen
  const live = new Map();  // request id -> every reply not ended yet, including ones "New chat" left
  let sessionTokens = 0;
  let sessionMicros = 0n;
  const queue = [];        // frames waiting for the socket to open

  // ---- the connection -----------------------------------------------------------------------------
  function setConn(state, label) {
    conn.className = "conn " + state;
    conn.querySelector("[data-label]").textContent = label;
    conn.dataset.state = state;
  }

  function connect() {
    if (socket && (socket.readyState === WebSocket.OPEN || socket.readyState === WebSocket.CONNECTING)) return;
    setConn("", "Connecting…");
    refusal = null;
    socket = new WebSocket(wsUrl);
    socket.addEventListener("open", () => {
      setConn("open", "Connected");
      while (queue.length) socket.send(queue.shift());
    });
    socket.addEventListener("message", (event) => onFrame(JSON.parse(event.data)));
    socket.addEventListener("close", (event) => {
      const refused = event.code >= 4000;
      setConn("closed", refused ? refusal || "Not authorized: reload the page" : "Disconnected");
      live.forEach((reply) => fail(reply, (refused && refusal) || "The connection closed before the reply finished."));
    });
  }

  function send(frame) {
    const text = JSON.stringify(frame);
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(text);
    else { queue.push(text); connect(); }
  }

  // ---- messages -------------------------------------------------------------------------------------
  function addMessage(role, text) {
    $("chat-empty")?.remove();
    const node = $("message-template").content.firstElementChild.cloneNode(true);
    node.classList.add(role);
    node.querySelector(".avatar").textContent = role === "user" ? "You".slice(0, 1) : "AI";
    node.querySelector(".who").textContent = role === "user" ? "You" : select.value;
    node.querySelector(".text").textContent = text;
    pane.appendChild(node);
    pane.scrollTop = pane.scrollHeight;
    return node;
  }

  // Makes `change` to the chat, then keeps its end in view if it was in view: the next tokens, and a
  // reply's chips (Stopped, tokens, cost) show whole, while a reader scrolled up stays where they are.
  function keepingEnd(change) {
    const atEnd = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 80;
    const result = change();
    if (atEnd) pane.scrollTop = pane.scrollHeight;
    return result;
  }

  function tag(node, text, attrs) {
    const span = document.createElement("span");
    span.className = "tag";
    span.textContent = text;
    Object.entries(attrs || {}).forEach(([k, v]) => span.setAttribute(k, v));
    node.querySelector(".meta").appendChild(span);
    return span;
  }

  // ---- parameters: sent as entered, or not at all -------------------------------------------------------
  const MAX_STOP = 4;  // the API's limit (OpenAI's)

  // A whole number as typed in an <input type=number>: the number, `fallback` when empty, NaN otherwise.
  // At most `digits` digits: up to 15, a JS number holds it exactly.
  function wholeNumber(field, fallback, digits) {
    if (field.validity.badInput) return NaN;
    const text = field.value.trim();
    if (text === "") return fallback;
    return new RegExp(`^-?\\d{1,${digits}}$`).test(text) ? Number(text) : NaN;
  }

  function stopSequences() {
    // One per line, kept as typed (commas and spaces included); blank lines are ignored.
    return $("p-stop").value.split("\n").map((line) => line.replace(/\r$/, "")).filter((line) => line !== "");
  }

  function showParamError(id, message) {
    const field = $(id), note = $(id + "-error");
    note.textContent = message || "";
    note.hidden = !message;
    if (message) field.setAttribute("aria-invalid", "true");
    else field.removeAttribute("aria-invalid");
  }

  // Max tokens: at most the selected model's context, which the API refuses to exceed (the field's
  // own max when the catalog does not know it).
  const maxField = $("p-max-tokens"), maxTokensCap = Number(maxField.max);

  function followContext() {
    const context = Number(select.selectedOptions[0]?.dataset.contextLength) || 0;
    maxField.max = String(context || maxTokensCap);
    const help = $("p-max-tokens-help");
    help.textContent = context ? `At most ${context.toLocaleString("en-US")}: this model's context, prompt included.` : "";
    help.hidden = !context;
    if (maxField.hasAttribute("aria-invalid") || Number(maxField.value) > Number(maxField.max)) {
      showParamError("p-max-tokens", maxTokensError());
    }
  }

  function maxTokensError() {
    const ceiling = Number(maxField.max), value = wholeNumber(maxField, 256, 9);
    return value >= 1 && value <= ceiling ? null : `Enter a whole number from 1 to ${ceiling.toLocaleString("en-US")}.`;
  }

  // The frame's sampling parameters, or null after showing what is wrong next to each field.
  function params() {
    const frame = { temperature: Number($("p-temperature").value), top_p: Number($("p-top-p").value) };
    const errors = {};
    const maxError = maxTokensError();
    if (maxError) errors["p-max-tokens"] = maxError;
    else frame.max_tokens = wholeNumber(maxField, 256, 9);
    const stops = stopSequences();
    if (stops.length > MAX_STOP) errors["p-stop"] = `At most ${MAX_STOP} stop sequences, one per line.`;
    else if (stops.length) frame.stop = stops;
    const seed = wholeNumber($("p-seed"), null, 15);
    if (Number.isNaN(seed)) errors["p-seed"] = "Enter a whole number of up to 15 digits, or nothing for a random seed.";
    else if (seed !== null) frame.seed = seed;
    if ($("p-json").checked) frame.response_format = { type: "json_object" };
    ["p-max-tokens", "p-stop", "p-seed"].forEach((id) => showParamError(id, errors[id]));
    const invalid = Object.keys(errors);
    if (invalid.length) {
      $(invalid[0]).focus();
      return null;
    }
    return frame;
  }

  function setBusy(busy) {
    sendButton.hidden = busy;
    stopButton.hidden = !busy;
    stopButton.disabled = false;
    select.disabled = busy;
    root.dataset.busy = busy ? "1" : "";
  }

  // Sends `text` as the next turn; false when nothing was sent (empty, busy, or invalid parameters).
  function ask(text) {
    text = text.trim();
    if (!text || current) return false;
    const sampling = params();
    if (!sampling) return false;
    const system = $("system-prompt").value.trim();
    const messages = (system ? [{ role: "system", content: system }] : []).concat(history, [{ role: "user", content: text }]);
    addMessage("user", text);
    history.push({ role: "user", content: text });
    const node = addMessage("assistant", "");
    node.classList.add("streaming");
    const requestId = "pg-" + Math.random().toString(36).slice(2, 12);
    current = { id: requestId, node, text: "", apiId: null, usage: null, stopped: false, finishReason: null, deployment: select.value,
                started: performance.now(), firstToken: null, left: false };
    live.set(requestId, current);
    node.dataset.requestId = requestId;
    node.dataset.state = "streaming";
    // A deployment scaled to zero loads its model first: say so when the first token is slow.
    current.waitTimer = setTimeout(() => {
      if (current && current.node === node && current.firstToken === null) {
        tag(node, "Waiting for the model to start (a cold start takes a few seconds)…", { class: "tag tag-muted" });
      }
    }, 2500);
    setBusy(true);
    send(Object.assign({ request_id: requestId, endpoint: "chat.completions", model: select.value, messages,
                         stream: true, stream_options: { include_usage: true } }, sampling));
    return true;
  }

  function onFrame(frame) {
    const reply = live.get(frame.request_id);
    if (!reply) {
      if (frame.type === "error" && frame.request_id === null) {
        refusal = frame.error?.message || "Error";
        setConn("closed", refusal);
      }
      return;
    }
    if (frame.type === "error") return fail(reply, frame.error?.message || "The request failed.");
    if (frame.type === "done") return finish(reply);
    if (frame.id && !reply.apiId) {
      reply.apiId = frame.id;
      reply.node.dataset.apiRequestId = frame.id;  // the usage record's request id
    }
    if (frame.usage) reply.usage = frame.usage;
    for (const choice of frame.choices || []) {
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (reply.firstToken === null) {
          reply.firstToken = performance.now();
          clearTimeout(reply.waitTimer);
          reply.node.querySelector(".meta").textContent = "";
        }
        reply.text += piece;
        keepingEnd(() => { reply.node.querySelector(".text").textContent = reply.text; });
      }
      if (choice.finish_reason) reply.finishReason = choice.finish_reason;
    }
  }

  function done(reply) {
    live.delete(reply.id);
    reply.node.classList.remove("streaming");
    clearTimeout(reply.cancelTimer);
    if (current !== reply) return;  // a reply "New chat" left: the chat on screen is not its
    current = null;
    setBusy(false);
    input.focus();
  }

  function fail(reply, message) {
    done(reply);
    clearTimeout(reply.waitTimer);
    reply.node.querySelector(".meta").textContent = "";
    reply.node.classList.add("error");
    reply.node.dataset.state = "error";
    keepingEnd(() => { reply.node.querySelector(".text").textContent = (reply.text ? reply.text + "\n\n" : "") + message; });
    if (!reply.left) history.pop();  // the question stays on screen but not in the context of the next turn
  }

  function finish(reply) {
    done(reply);
    reply.node.dataset.state = reply.stopped ? "stopped" : "done";
    if (!reply.left) history.push({ role: "assistant", content: reply.text });
    const seconds = ((performance.now() - reply.started) / 1000).toFixed(1);
    clearTimeout(reply.waitTimer);
    const costTag = keepingEnd(() => chips(reply, seconds));
    if (!costTag) return;
    const u = reply.usage;
    const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
    sessionTokens += u.total_tokens;
    $("session-tokens").textContent = sessionTokens.toLocaleString("en-US");
    fetchCost(reply, u, cached, costTag, 0, null);
  }

  // A finished reply's chips: Stopped or Cut at max tokens, its tokens, its time, and its cost's tag
  // (returned, filled in once the cost is known); null when nothing was generated.
  function chips(reply, seconds) {
    reply.node.querySelector(".meta").textContent = "";
    if (reply.stopped) tag(reply.node, "Stopped", { "data-stopped": "1", class: "tag tag-warn" });
    // Without this chip, a reply ended by Max tokens reads as if the model had finished it.
    if (reply.finishReason === "length") {
      tag(reply.node, "Cut at max tokens", { "data-cut": "1", class: "tag tag-warn",
                                             title: "The reply reached Max tokens: raise it under Parameters for a longer one." });
    }
    const u = reply.usage;
    if (!u) {
      tag(reply.node, "Nothing generated");
      return null;
    }
    tag(reply.node, `${u.prompt_tokens} in · ${u.completion_tokens} out`, { "data-tokens": String(u.total_tokens) });
    tag(reply.node, `${seconds} s`);
    return tag(reply.node, "…", { "data-cost": "" });
  }

  function fetchCost(reply, usage, cached, costTag, attempt, counted) {
    const query = new URLSearchParams({
      request_id: reply.apiId || "", organization: organizationId, deployment: reply.deployment, prompt_tokens: usage.prompt_tokens,
      cached_prompt_tokens: cached, completion_tokens: usage.completion_tokens,
      status: reply.stopped ? "cancelled" : "completed",
    });
    fetch(`${costUrl}?${query}`, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : Promise.reject(r.status)))
      .then((body) => {
        const value = micros(body.cost);
        sessionMicros += value - (counted === null ? 0n : counted);
        $("session-cost").textContent = formatUsd(sessionMicros);
        costTag.textContent = formatUsd(value) + (body.source === "billed" ? "" : " (estimate)");
        costTag.setAttribute("data-cost", body.cost);
        costTag.setAttribute("data-source", body.source);
        costTag.title = body.source === "billed" ? "Billed to your credit" : "Computed with the model's prices; billing records it in a moment";
        if (body.source !== "billed" && attempt < 8) {
          setTimeout(() => fetchCost(reply, usage, cached, costTag, attempt + 1, value), 1000);
        }
      })
      .catch(() => { costTag.textContent = "cost unavailable"; });
  }

  function stop() {
    if (!current || current.stopped) return;
    const reply = current;
    reply.stopped = true;
    stopButton.disabled = true;
    send({ type: "cancel", request_id: reply.id });
    // A request cancelled before any worker took it ends without a frame: end it here.
    reply.cancelTimer = setTimeout(() => { if (live.has(reply.id)) finish(reply); }, 8000);
  }

  // "New chat": a reply still streaming is cancelled and left to end off screen (its tokens and cost
  // still count in the session's totals), outside the new chat's history.
  function newChat() {
    if (current) {
      const reply = current;
      stop();
      reply.left = true;
      current = null;
      setBusy(false);
    }
    history = [];
    pane.querySelectorAll(".msg").forEach((n) => n.remove());
    if (emptyState) pane.appendChild(emptyState);
    input.focus();
  }

  // ---- wiring -------------------------------------------------------------------------------------------
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!ask(input.value)) return;  // what was typed stays, to send once the parameters are fixed
    input.value = "";
    input.style.height = "";
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  input.addEventListener("input", () => {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, 180) + "px";
  });
  stopButton.addEventListener("click", stop);
  $("clear-button").addEventListener("click", newChat);
  pane.addEventListener("click", (event) => {
    const suggestion = event.target.closest("[data-suggest]");
    if (suggestion) ask(suggestion.dataset.suggest);
  });
  [["p-temperature", "o-temperature", 2], ["p-top-p", "o-top-p", 2]].forEach(([id, out, digits]) => {
    const update = () => { $(out).textContent = Number($(id).value).toFixed(digits); };
    $(id).addEventListener("input", update);
    update();
  });
  select.addEventListener("change", () => {
    const url = new URL(window.location.href);
    url.searchParams.set("deployment", select.value);
    window.history.replaceState(null, "", url);
    followContext();
  });
  followContext();
  connect();
  input.focus();
})();
