// The chat page: the conversation, the settings, and one streamed answer at a time.

import { listModels, streamChatCompletion } from "./api.js";
import { AnswerTimer, describeSummary } from "./answer-timer.js";
import { renderMarkdown } from "./markdown.js";

const API_KEY_STORAGE = "pagedllm-api-key"; // sessionStorage: the key lives as long as the tab

const byId = (id) => document.getElementById(id);
const ui = {
  model: byId("model"),
  connection: byId("connection"),
  newChat: byId("new-chat"),
  apiKeyForm: byId("api-key-form"),
  apiKey: byId("api-key"),
  systemPrompt: byId("system-prompt"),
  temperature: byId("temperature"),
  temperatureValue: byId("temperature-value"),
  topP: byId("top-p"),
  topPValue: byId("top-p-value"),
  maxTokens: byId("max-tokens"),
  error: byId("error"),
  messages: byId("messages"),
  composer: byId("composer"),
  prompt: byId("prompt"),
  send: byId("send"),
  stop: byId("stop"),
};

const state = {
  apiKey: sessionStorage.getItem(API_KEY_STORAGE) ?? "",
  history: [], // the conversation's user and assistant turns; the system prompt is read at every send
  generation: null, // the AbortController of the answer being streamed, if any
};

// ---- models and the API key --------------------------------------------------------------------------

async function connect() {
  setConnection("connecting…");
  try {
    const models = await listModels({ apiKey: state.apiKey });
    ui.model.replaceChildren(...models.map((id) => new Option(id, id)));
    ui.model.disabled = models.length === 0;
    ui.apiKeyForm.hidden = true;
    hideError();
    setConnection(`connected · ${models.length} model${models.length === 1 ? "" : "s"}`);
    updateButtons();
  } catch (error) {
    if (error.needsApiKey) {
      askForApiKey(state.apiKey ? error.message : null);
      setConnection("API key needed");
    } else {
      showError(error.message);
      setConnection("not connected");
    }
  }
}

function askForApiKey(problem) {
  ui.apiKeyForm.hidden = false;
  if (problem) showError(problem);
  ui.apiKey.focus();
}

ui.apiKeyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  state.apiKey = ui.apiKey.value.trim();
  sessionStorage.setItem(API_KEY_STORAGE, state.apiKey);
  connect();
});

// ---- settings ------------------------------------------------------------------------------------------

function showSliderValues() {
  ui.temperatureValue.value = Number(ui.temperature.value).toFixed(2);
  ui.topPValue.value = Number(ui.topP.value).toFixed(2);
}

ui.temperature.addEventListener("input", showSliderValues);
ui.topP.addEventListener("input", showSliderValues);

function requestBody() {
  const system = ui.systemPrompt.value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.history] : [...state.history];
  const body = {
    model: ui.model.value,
    messages,
    temperature: Number(ui.temperature.value),
    top_p: Number(ui.topP.value),
  };
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  if (Number.isFinite(maxTokens)) body.max_tokens = maxTokens; // left out: the server fills the context
  return body;
}

// ---- the conversation ----------------------------------------------------------------------------------

function addMessage(role) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  item.append(content);
  ui.messages.append(item);
  return item;
}

function addUserMessage(text) {
  const item = addMessage("user");
  item.querySelector(".content").textContent = text; // the user's own words, shown as typed
  scrollToEnd();
  return item;
}

// The answer's bubble; rendering is batched to one per frame, however fast the tokens come.
function addAnswer() {
  const item = addMessage("assistant");
  item.classList.add("streaming");
  const content = item.querySelector(".content");
  let text = "";
  let frame = null;
  const render = () => {
    frame = null;
    const follow = isScrolledToEnd();
    content.replaceChildren(renderMarkdown(text));
    if (follow) scrollToEnd();
  };
  return {
    item,
    get text() {
      return text;
    },
    append(delta) {
      text += delta;
      frame ??= requestAnimationFrame(render);
    },
    finish(outcome, statsLine) {
      if (frame !== null) cancelAnimationFrame(frame);
      render();
      item.classList.remove("streaming");
      item.dataset.outcome = outcome;
      const stats = document.createElement("div");
      stats.className = "stats";
      stats.textContent = statsLine;
      item.append(stats);
    },
  };
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || state.generation || !ui.model.value) return;
  hideError();
  // this turn belongs to this conversation, even if "New chat" replaces it while the answer streams
  const history = state.history;
  history.push({ role: "user", content: text });
  const body = requestBody();
  const userMessage = addUserMessage(text);
  ui.prompt.value = "";
  const answer = addAnswer();
  const timer = new AnswerTimer();
  const controller = new AbortController();
  state.generation = controller;
  updateButtons();

  let usage = null;
  let finishReason = null;
  let outcome = "complete";
  let failure = null;
  try {
    for await (const chunk of streamChatCompletion(body, { apiKey: state.apiKey, signal: controller.signal })) {
      const choice = chunk.choices[0];
      if (choice?.delta?.content) {
        timer.onContent();
        answer.append(choice.delta.content);
      }
      if (choice?.finish_reason) finishReason = choice.finish_reason;
      if (chunk.usage) usage = chunk.usage;
    }
  } catch (error) {
    if (error.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "failed";
      failure = error;
    }
  } finally {
    state.generation = null;
    updateButtons();
  }

  if (!answer.text && outcome !== "complete") {
    // nothing came back: undo the turn and give the words back, to fix the cause (or think again) and resend
    history.pop();
    userMessage.remove();
    answer.item.remove();
    if (!ui.prompt.value && history === state.history) ui.prompt.value = text;
  } else {
    // a stopped or broken answer stays in the conversation as far as it got
    history.push({ role: "assistant", content: answer.text });
    const notes = [describeSummary(timer.summary(usage?.completion_tokens ?? null))];
    if (outcome === "stopped") notes.push("stopped");
    if (outcome === "failed") notes.push("interrupted");
    if (finishReason === "length") notes.push("max tokens reached");
    answer.finish(outcome, notes.join(" · "));
  }
  if (failure) {
    showError(failure.message);
    if (failure.needsApiKey) askForApiKey(null);
  }
}

function stop() {
  state.generation?.abort(); // closing the connection makes the server abort the request
}

function newChat() {
  stop();
  state.history = [];
  ui.messages.replaceChildren();
  hideError();
  ui.prompt.focus();
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);

// ---- page state ----------------------------------------------------------------------------------------

function updateButtons() {
  const generating = state.generation !== null;
  ui.send.hidden = generating;
  ui.stop.hidden = !generating;
  ui.send.disabled = generating || ui.model.disabled;
  document.body.classList.toggle("generating", generating);
}

function setConnection(text) {
  ui.connection.textContent = text;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

function isScrolledToEnd() {
  const list = ui.messages;
  return list.scrollHeight - list.scrollTop - list.clientHeight < 40;
}

function scrollToEnd() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

showSliderValues();
connect();
