// The OpenAI-compatible API at /v1, as the page uses it: list the models, stream a chat completion.
// Every failure becomes an ApiError whose message a person can read.

// Relative to the page (/chat/), so the page keeps working behind a proxy that adds a path prefix.
const API_BASE = new URL("../v1/", document.baseURI);

export class ApiError extends Error {
  constructor(message, { status = null, code = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status; // HTTP status, or null when the server was not reached or the stream broke
    this.code = code; // OpenAI's error code, e.g. "invalid_api_key"
  }

  get needsApiKey() {
    return this.status === 401;
  }
}

function headers(apiKey) {
  const result = { "Content-Type": "application/json" };
  if (apiKey) result.Authorization = `Bearer ${apiKey}`;
  return result;
}

async function request(path, { apiKey, method = "GET", body, signal }) {
  let response;
  try {
    response = await fetch(new URL(path, API_BASE), {
      method,
      headers: headers(apiKey),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(`Could not reach the server (${error.message}).`);
  }
  if (!response.ok) throw await errorFromResponse(response);
  return response;
}

// OpenAI's error object is {"error": {"message", "type", "code", ...}}; anything else (a proxy's HTML page,
// an empty body) still yields the status line.
async function errorFromResponse(response) {
  let detail = null;
  try {
    detail = (await response.json()).error;
  } catch {
    // not JSON: keep the status line alone
  }
  const status = `${response.status} ${response.statusText}`.trim();
  const message = detail?.message ? `${detail.message} (HTTP ${status})` : `The server answered HTTP ${status}.`;
  return new ApiError(message, { status: response.status, code: detail?.code ?? null });
}

export async function listModels({ apiKey, signal } = {}) {
  const response = await request("models", { apiKey, signal });
  const models = await response.json();
  return models.data.map((model) => model.id);
}

// Yields each chunk of a streamed chat completion, as parsed JSON, until [DONE]. Aborting `signal` closes
// the connection, which makes the server abort the request and free its KV cache.
export async function* streamChatCompletion(body, { apiKey, signal }) {
  const response = await request("chat/completions", {
    apiKey,
    method: "POST",
    body: { ...body, stream: true, stream_options: { include_usage: true } },
    signal,
  });
  for await (const data of serverSentEvents(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    // a failure after the stream began arrives as an event carrying OpenAI's error object
    if (chunk.error) throw new ApiError(chunk.error.message, { code: chunk.error.code ?? null });
    yield chunk;
  }
  throw new ApiError("The stream ended before the answer was complete.");
}

// The `data:` payload of each Server-Sent Event, as text.
async function* serverSentEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    // closes the connection when the caller stops early; a no-op once the stream has ended
    reader.cancel().catch(() => {});
  }
}
