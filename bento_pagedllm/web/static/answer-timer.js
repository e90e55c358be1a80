// Time to first token and decoding speed of one answer, as the browser sees them (network included).

export class AnswerTimer {
  constructor() {
    this.sentAt = performance.now();
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.contentChunks = 0;
  }

  // Called for every streamed chunk that carries text.
  onContent() {
    const now = performance.now();
    this.firstTokenAt ??= now;
    this.lastTokenAt = now;
    this.contentChunks += 1;
  }

  // `completionTokens` comes from the stream's usage chunk; a stopped answer has none, so its count is the
  // number of text chunks (the server sends one per token, fewer when it holds back part of a character).
  summary(completionTokens = null) {
    const exact = completionTokens !== null;
    const tokens = exact ? completionTokens : this.contentChunks;
    const timeToFirstTokenMs = this.firstTokenAt === null ? null : this.firstTokenAt - this.sentAt;
    // decoding speed: the tokens after the first, over the time they took (the first one pays for the prompt)
    const decodeSeconds = this.firstTokenAt === null ? 0 : (this.lastTokenAt - this.firstTokenAt) / 1000;
    const tokensPerSecond = tokens > 1 && decodeSeconds > 0 ? (tokens - 1) / decodeSeconds : null;
    return { tokens, exact, timeToFirstTokenMs, tokensPerSecond };
  }
}

export function describeSummary({ tokens, exact, timeToFirstTokenMs, tokensPerSecond }) {
  const parts = [`${exact ? "" : "~"}${tokens} tokens`];
  if (tokensPerSecond !== null) parts.push(`${tokensPerSecond.toFixed(1)} tokens/s`);
  if (timeToFirstTokenMs !== null) parts.push(`first token ${Math.round(timeToFirstTokenMs)} ms`);
  return parts.join(" · ");
}
