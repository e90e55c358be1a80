// A small Markdown renderer for model answers: paragraphs, headings, fenced and inline code, lists,
// block quotes, rules, emphasis, strike-through and links.
//
// Safe by construction: it never parses HTML. It builds DOM nodes, and every piece of text reaches the page
// through a text node, so "<script>" or "<img onerror=...>" in model output shows up as those characters.
// Links keep only http(s) and mailto targets, so "javascript:" URLs are never clickable.
//
// It renders partial input too: an answer is re-rendered as it streams, so an unclosed code fence shows as
// code so far.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const BULLET_ITEM = /^ {0,3}[-*+]\s+/;
const NUMBERED_ITEM = /^ {0,3}(\d{1,9})[.)]\s+/;
const SAFE_URL = /^(https?:|mailto:)/i;

// One inline construct per alternative; the first (leftmost) match wins.
const INLINE = new RegExp(
  [
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1-2: code span
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 3: strong
    /__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 4: strong
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 5: emphasis
    /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source, // 6: emphasis, not inside snake_case words
    /~~(?=\S)([\s\S]*?\S)~~/.source, // 7: strike-through
    /\[([^\]\n]+)\]\(\s*<?([^\s<>()]+)>?\s*\)/.source, // 8-9: link
    /\bhttps?:\/\/[^\s<>()"']*[^\s<>()"'.,;:!?]/.source, // bare URL (the whole match)
  ].join("|"),
);

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  appendBlocks(fragment, text.replace(/\r\n?/g, "\n").split("\n"));
  return fragment;
}

function element(tag, ...children) {
  const node = document.createElement(tag);
  node.append(...children); // strings become text nodes
  return node;
}

function isBlank(line) {
  return line.trim() === "";
}

// Does this line begin a block other than a paragraph (so it ends the paragraph before it)?
function startsBlock(line) {
  return [FENCE, HEADING, RULE, QUOTE, BULLET_ITEM, NUMBERED_ITEM].some((pattern) => pattern.test(line));
}

function appendBlocks(parent, lines) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (isBlank(line)) {
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      i = appendCodeBlock(parent, lines, i, match);
    } else if ((match = HEADING.exec(line))) {
      parent.append(element(`h${match[1].length}`, ...inline(match[2])));
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(element("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].replace(QUOTE, ""));
      const quote = element("blockquote");
      appendBlocks(quote, quoted);
      parent.append(quote);
    } else if (BULLET_ITEM.test(line) || NUMBERED_ITEM.test(line)) {
      i = appendList(parent, lines, i);
    } else {
      const paragraph = [];
      while (i < lines.length && !isBlank(lines[i]) && !(paragraph.length && startsBlock(lines[i]))) {
        paragraph.push(lines[i++].trim());
      }
      parent.append(element("p", ...withLineBreaks(paragraph)));
    }
  }
}

function appendCodeBlock(parent, lines, start, [, fence, language]) {
  const body = [];
  let i = start + 1;
  // the closing fence uses the same character, at least as long; a stream may not have sent it yet
  while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
  const code = element("code", body.join("\n"));
  if (language) code.dataset.language = language;
  parent.append(element("pre", code));
  return i + 1;
}

// A run of items of one kind. An indented line continues the item before it; nested lists come out flat.
function appendList(parent, lines, start) {
  const numbered = NUMBERED_ITEM.test(lines[start]);
  const marker = numbered ? NUMBERED_ITEM : BULLET_ITEM;
  const list = element(numbered ? "ol" : "ul");
  if (numbered) {
    const first = Number(NUMBERED_ITEM.exec(lines[start])[1]);
    if (first !== 1) list.start = first;
  }
  const items = []; // each item is its lines
  let i = start;
  for (; i < lines.length; i += 1) {
    const line = lines[i];
    if (marker.test(line)) {
      items.push([line.replace(marker, "")]);
    } else if (/^\s+\S/.test(line)) {
      items.at(-1).push(line.trim());
    } else if (!(isBlank(line) && marker.test(lines[i + 1] ?? ""))) {
      break; // a blank line between two items does not end the list; anything else does
    }
  }
  for (const item of items) list.append(element("li", ...withLineBreaks(item)));
  parent.append(list);
  return i;
}

// Lines of one paragraph: chat answers mean their line breaks, so they are kept.
function withLineBreaks(lines) {
  const nodes = [];
  lines.forEach((line, index) => {
    if (index > 0) nodes.push(element("br"));
    nodes.push(...inline(line));
  });
  return nodes;
}

// Inline Markdown as a list of nodes and strings.
function inline(text) {
  const nodes = [];
  let rest = text;
  let match;
  while ((match = INLINE.exec(rest))) {
    if (match.index > 0) nodes.push(rest.slice(0, match.index));
    nodes.push(inlineNode(match));
    rest = rest.slice(match.index + match[0].length);
  }
  if (rest) nodes.push(rest);
  return nodes;
}

function inlineNode(match) {
  const [whole, , code, strong, strongAlt, emphasis, emphasisAlt, strike, linkText, linkUrl] = match;
  if (code !== undefined) return element("code", stripOneSpace(code));
  if (strong !== undefined || strongAlt !== undefined) return element("strong", ...inline(strong ?? strongAlt));
  if (emphasis !== undefined || emphasisAlt !== undefined) {
    return element("em", ...inline(emphasis ?? emphasisAlt));
  }
  if (strike !== undefined) return element("del", ...inline(strike));
  if (linkText !== undefined) return link(linkUrl, inline(linkText), whole);
  return link(whole, [whole], whole); // a bare URL
}

// "`` `x` ``" shows as "`x`": one space on each side lets a code span start or end with a backtick
function stripOneSpace(code) {
  return code.length > 2 && code.startsWith(" ") && code.endsWith(" ") ? code.slice(1, -1) : code;
}

function link(url, children, source) {
  if (!SAFE_URL.test(url)) return source; // shown as the text it was, never as a link
  const anchor = element("a", ...children);
  anchor.href = url;
  anchor.target = "_blank";
  anchor.rel = "noopener noreferrer nofollow";
  return anchor;
}
