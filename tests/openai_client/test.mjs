// The OpenAI-compatible API end to end, with the official `openai` npm package as the client:
// starts llava-server with the default model (one running request, one waiting, so the queue can
// be filled), then checks non-streaming and streaming chat with an image against llava-generate's
// answer for the same prompt, the kv_cache extension through extra body fields, usage, a
// cancelled stream (the request ends "cancelled" and its cache is freed), each error class, the
// README's curl examples as written, and a graceful drain (503 for new requests, the running
// stream finishes).
//
// usage: node test.mjs SOURCE_DIR BIN_DIR
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import net from "node:net";
import assert from "node:assert/strict";
import OpenAI from "openai";

const [SRC, BIN] = process.argv.slice(2);
const IMAGE = `${SRC}/models/examples/scene1.png`;
const dataUri = "data:image/png;base64," + readFileSync(IMAGE).toString("base64");
const failures = [];

async function check(name, fn) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failures.push(name);
    console.log(`FAIL ${name}: ${e.stack || e}`);
  }
}

function startServer(extra = []) {
  const args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--http-listen", "127.0.0.1:0", "--threads", "1", ...extra];
  const proc = spawn(`${BIN}/llava-server`, args, { stdio: ["ignore", "pipe", "pipe"] });
  let log = "";
  const ports = new Promise((resolve, reject) => {
    const onData = (d) => {
      log += d.toString();
      const http = log.match(/OpenAI-compatible API on port (\d+)/);
      const metrics = log.match(/metrics on port (\d+)/);
      if (http && metrics && log.includes("serving on port")) {
        resolve({ http: Number(http[1]), metrics: Number(metrics[1]) });
      }
    };
    proc.stdout.on("data", onData);
    proc.stderr.on("data", onData);
    proc.on("exit", (code) => reject(new Error(`llava-server exited (${code}):\n${log}`)));
    setTimeout(() => reject(new Error(`llava-server did not start:\n${log}`)), 60000);
  });
  return { proc, ports, log: () => log };
}

// The value of the series `name` (with its labels, as exposed) on /metrics.
async function metric(port, name) {
  const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
  const line = text.split("\n").find((l) => l.split(" ")[0] === name);
  assert.ok(line, `${name} is not on /metrics`);
  return Number(line.split(" ").pop());
}

function imageMessage(text) {
  return [{ role: "user", content: [
    { type: "image_url", image_url: { url: dataUri } },
    { type: "text", text },
  ] }];
}

// The reference answer: llava-generate, the engine without any server, same prompt, Full cache.
const QUESTION = "Describe the image in detail.";
const reference = execFileSync(`${BIN}/llava-generate`, ["--image", IMAGE, "--prompt", QUESTION,
  "--policy", "full", "--max-tokens", "96", "--threads", "1"], { encoding: "utf8" }).trim();
assert.ok(reference.length > 20, `llava-generate gave "${reference}"`);

const server = startServer(["--max-batch", "1", "--max-queue", "1", "--http-max-body-bytes", "400000"]);
const ports = await server.ports;
const base = `http://127.0.0.1:${ports.http}`;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });
const full = { kv_cache: { policy: "full" } };

await check("models.list names the served model", async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ["shapes-llava"]);
  const one = await client.models.retrieve("shapes-llava");
  assert.equal(one.object, "model");
});

let nonStreamText = "";
await check("non-streaming chat with an image gives llava-generate's answer", async () => {
  const r = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 96, ...full });
  assert.equal(r.object, "chat.completion");
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, "assistant");
  assert.equal(r.choices[0].message.content, reference);
  assert.ok(["stop", "length"].includes(r.choices[0].finish_reason));
  const u = r.usage;
  assert.equal(u.total_tokens, u.prompt_tokens + u.completion_tokens);
  assert.ok(u.image_tokens > 0 && u.image_tokens < u.prompt_tokens, JSON.stringify(u));
  assert.ok(u.completion_tokens > 5);
  assert.equal(u.kv_bytes_used, u.kv_bytes_full, "Full keeps every entry");
  assert.equal(u.kv_saved_ratio, 0);
  nonStreamText = r.choices[0].message.content;
});

await check("the kv_cache extension (extra_body) sets policy and budget", async () => {
  const r = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 48,
    kv_cache: { policy: "elastic", budget: 0.2 } });
  const u = r.usage;
  assert.ok(u.kv_bytes_used <= 0.3 * u.kv_bytes_full, JSON.stringify(u));
  assert.ok(u.kv_saved_ratio > 0.7, JSON.stringify(u));
  assert.ok(u.tokens_merged > 0, "Elastic merges prompt entries");
  const h2o = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 8,
    kv_cache: { policy: "h2o", budget: 0.5 } });
  assert.equal(h2o.usage.tokens_merged, 0, "H2O evicts, never merges");
  assert.ok(h2o.usage.tokens_evicted > 0);
});

await check("streaming: role first, deltas concatenate to the non-streamed answer, usage last", async () => {
  const stream = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 96, stream: true,
    stream_options: { include_usage: true }, ...full });
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  assert.equal(chunks[0].choices[0].delta.role, "assistant");
  const withChoice = chunks.filter((c) => c.choices.length > 0);
  const text = withChoice.map((c) => c.choices[0].delta.content ?? "").join("");
  assert.equal(text, nonStreamText);
  const finishes = withChoice.map((c) => c.choices[0].finish_reason).filter((f) => f !== null);
  assert.equal(finishes.length, 1, "one chunk carries the finish reason");
  const last = chunks[chunks.length - 1];
  assert.deepEqual(last.choices, []);
  assert.ok(last.usage.completion_tokens > 5);
  for (const c of chunks.slice(0, -1)) assert.equal(c.usage, null);
  assert.ok(chunks.every((c) => c.id === chunks[0].id && c.object === "chat.completion.chunk"));
  // Without include_usage there is no usage chunk.
  const plain = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage("How many objects are there?"), max_tokens: 8,
    stream: true });
  const plainChunks = [];
  for await (const c of plain) plainChunks.push(c);
  assert.ok(plainChunks.every((c) => c.choices.length === 1 && c.usage === undefined));
});

await check("stop strings, temperature, seed, multi-turn with system and assistant", async () => {
  const stopAt = nonStreamText.split(" ").slice(3, 4)[0];
  const r = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 96, stop: [stopAt],
    ...full });
  assert.ok(!r.choices[0].message.content.includes(stopAt), r.choices[0].message.content);
  assert.equal(r.choices[0].finish_reason, "stop");
  const sampled = async () => (await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 24, temperature: 1.0,
    top_p: 0.9, seed: 7 })).choices[0].message.content;
  assert.equal(await sampled(), await sampled(), "same seed, same answer");
  const multi = await client.chat.completions.create({ model: "shapes-llava", max_tokens: 16,
    messages: [
      { role: "system", content: "You answer briefly." },
      ...imageMessage("How many objects are there?"),
      { role: "assistant", content: "1" },
      { role: "user", content: [{ type: "text", text: "What colour is it?" }] },
    ] });
  assert.ok(multi.choices[0].message.content.length > 0);
});

await check("a cancelled stream ends its request and frees its cache", async () => {
  const before = await metric(ports.metrics, 'llava_request_success_total{finish_reason="cancelled"}');
  const stream = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 800, ignore_eos: true,
    stream: true });
  let n = 0;
  for await (const _ of stream) if (++n === 5) break;  // breaking aborts the HTTP request
  let after = before;
  for (let i = 0; i < 50 && after === before; ++i) {
    await new Promise((r) => setTimeout(r, 100));
    after = await metric(ports.metrics, 'llava_request_success_total{finish_reason="cancelled"}');
  }
  assert.equal(after, before + 1);
  assert.equal(await metric(ports.metrics, "llava_num_requests_running"), 0);
  assert.equal(await metric(ports.metrics, "llava_kv_cache_used_bytes"), 0);
});

async function expectError(body, status, param, messagePart) {
  let caught;
  try {
    await client.chat.completions.create(body);
  } catch (e) {
    caught = e;
  }
  assert.ok(caught, "no error");
  assert.equal(caught.status, status, `${caught.status}: ${caught.message} ${caught.cause ?? ""}`);
  if (param !== undefined) assert.equal(caught.param, param, caught.message);
  if (messagePart) assert.match(caught.message, messagePart);
  return caught;
}

await check("400: n > 1, wrong types, remote URLs, bad data URIs, bad budgets", async () => {
  const ok = { model: "shapes-llava", messages: imageMessage("Hi"), max_tokens: 4 };
  await expectError({ ...ok, n: 2 }, 400, "n");
  await expectError({ ...ok, temperature: "hot" }, 400, "temperature", /must be a number/);
  await expectError({ ...ok, top_p: 2 }, 400, "top_p");
  await expectError({ ...ok, max_tokens: 0 }, 400, "max_tokens");
  await expectError({ ...ok, messages: "hello" }, 400, "messages");
  await expectError({ ...ok, messages: [{ role: "tool", content: "x" }] }, 400, "messages[0].role");
  const url = (u) => [{ role: "user", content: [{ type: "image_url", image_url: { url: u } },
                                                { type: "text", text: "Hi" }] }];
  await expectError({ ...ok, messages: url("https://example.com/cat.png") }, 400,
                    "messages[0].content[0].image_url.url", /not fetched/);
  await expectError({ ...ok, messages: url("data:image/png;base64,@@@@") }, 400,
                    "messages[0].content[0].image_url.url", /base64/);
  await expectError({ ...ok, messages: url("data:image/png;base64," + Buffer.from("not an image at all").toString("base64")) },
                    400, "messages[0].content[0].image_url.url");
  await expectError({ ...ok, kv_cache: { policy: "elastic", budget: 0 } }, 400, "kv_cache.budget");
  await expectError({ ...ok, kv_cache: { policy: "lru" } }, 400, "kv_cache.policy");
});

await check("400 for a decompression bomb, 413 for a body over the limit", async () => {
  // A 1 x 100000 PNG of a few hundred bytes: within the byte limit, refused by its shape.
  const bomb = execFileSync("python3", ["-c", `
import zlib, struct, base64, sys
w, h = 100000, 1
raw = b"".join(b"\\x00" + b"\\x00" * (3 * w) for _ in range(h))
def chunk(t, d): return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
png = b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
sys.stdout.write(base64.b64encode(png).decode())`], { encoding: "utf8" });
  await expectError({ model: "shapes-llava", max_tokens: 4, messages: [{ role: "user", content: [
    { type: "image_url", image_url: { url: "data:image/png;base64," + bomb } },
    { type: "text", text: "Hi" }] }] }, 400, "messages[0].content[0].image_url.url");
  await expectError({ model: "shapes-llava", max_tokens: 4,
                      messages: [{ role: "user", content: "x".repeat(500000) }] }, 413);
});

await check("400 for malformed JSON, 404 for an unknown model or path", async () => {
  const r = await fetch(`${base}/v1/chat/completions`, { method: "POST", body: "{\"model\": " });
  assert.equal(r.status, 400);
  const body = await r.json();
  assert.equal(body.error.type, "invalid_request_error");
  assert.match(body.error.message, /not valid JSON/);
  await expectError({ model: "gpt-4o", messages: imageMessage("Hi") }, 404, null, /shapes-llava/);
  const missing = await fetch(`${base}/v1/embeddings`, { method: "POST", body: "{}" });
  assert.equal(missing.status, 404);
  assert.ok((await missing.json()).error.message.length > 0);
});

await check("slow and idle clients do not hold up a request", async () => {
  // Three connections that send half a request and then nothing, one byte at a time.
  const slow = [];
  for (let i = 0; i < 3; ++i) {
    const sock = net.connect(ports.http, "127.0.0.1");
    sock.on("error", () => {});
    sock.write("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{");
    slow.push(sock);
  }
  const timer = setInterval(() => slow.forEach((s) => s.write(" ")), 200);
  const t0 = Date.now();
  const r = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage("How many objects are there?"), max_tokens: 8 });
  clearInterval(timer);
  slow.forEach((s) => s.destroy());
  assert.ok(r.choices[0].message.content.length > 0);
  assert.ok(Date.now() - t0 < 5000, `took ${Date.now() - t0} ms`);
  const status = await metric(ports.metrics, 'llava_request_status_total{api="openai",code="OK"}');
  assert.ok(status > 5, `llava_request_status_total{api="openai",code="OK"} = ${status}`);
});

await check("504 when the request's timeout passes", async () => {
  await expectError({ model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 800,
                      ignore_eos: true, timeout: 0.05 }, 504);
});

await check("429 when the queue is full (one running, one waiting)", async () => {
  const long = { model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 800,
                 ignore_eos: true, stream: true };
  const a = await client.chat.completions.create(long);
  const aIter = a[Symbol.asyncIterator]();
  await aIter.next();  // running
  const b = await client.chat.completions.create(long);  // waiting: headers come at once
  await expectError({ ...long, stream: false }, 429, null, /queue/);
  a.controller.abort();
  b.controller.abort();
  for (let i = 0; i < 50; ++i) {  // both cancelled and gone before the next test
    const busy = await metric(ports.metrics, "llava_num_requests_running") +
                 await metric(ports.metrics, "llava_num_requests_waiting");
    if (busy === 0) break;
    await new Promise((r) => setTimeout(r, 100));
  }
});

await check("the README's curl examples, run as written", async () => {
  const readme = readFileSync(`${SRC}/README.md`, "utf8");
  const blocks = [...readme.matchAll(/<!-- openai-curl -->\s*```sh\n([\s\S]*?)```/g)].map((m) => m[1]);
  assert.ok(blocks.length >= 2, `found ${blocks.length} marked curl examples`);
  for (const block of blocks) {
    const out = execFileSync("bash", ["-euo", "pipefail", "-c", block], {
      cwd: SRC, encoding: "utf8", env: { ...process.env, LLAVA_HTTP: base } });
    assert.match(out, /"choices"|"data"|data: /, out.slice(0, 300));
    assert.doesNotMatch(out, /"error"/, out.slice(0, 300));
  }
});

await check("401 without the server's bearer token; the OpenAI api_key is the token", async () => {
  const dir = mkdtempSync(`${tmpdir()}/llava-auth-`);
  writeFileSync(`${dir}/tokens`, "sdk-test 0123456789abcdef-token\n");
  const secured = startServer(["--auth-tokens-file", `${dir}/tokens`]);
  try {
    const p = await secured.ports;
    const url = `http://127.0.0.1:${p.http}/v1`;
    const good = new OpenAI({ baseURL: url, apiKey: "0123456789abcdef-token", maxRetries: 0 });
    const r = await good.chat.completions.create({
      model: "shapes-llava", messages: imageMessage("How many objects are there?"), max_tokens: 4 });
    assert.ok(r.choices[0].message.content.length > 0);
    const wrong = new OpenAI({ baseURL: url, apiKey: "0123456789abcdef-tokem", maxRetries: 0 });
    for (const call of [() => wrong.models.list(),
                        () => wrong.chat.completions.create({ model: "shapes-llava", messages: imageMessage("Hi") })]) {
      let caught;
      try { await call(); } catch (e) { caught = e; }
      assert.ok(caught instanceof OpenAI.AuthenticationError, `${caught}`);
      assert.equal(caught.status, 401);
      assert.equal(caught.code, "invalid_api_key");
    }
    assert.match(secured.log(), /client=sdk-test/);
    assert.doesNotMatch(secured.log(), /0123456789abcdef-tok/, "a token reached the log");
    // Probes and scrapes need no token.
    assert.equal((await fetch(`http://127.0.0.1:${p.metrics}/healthz`)).status, 200);
  } finally {
    secured.proc.kill("SIGKILL");
  }
});

await check("draining: new requests get 503, the running stream finishes", async () => {
  const stream = await client.chat.completions.create({
    model: "shapes-llava", messages: imageMessage(QUESTION), max_tokens: 850, ignore_eos: true,
    stream: true });  // ~2 s here: the drain outlasts the next request
  const it = stream[Symbol.asyncIterator]();
  await it.next();
  server.proc.kill("SIGTERM");
  await new Promise((r) => setTimeout(r, 250));
  await expectError({ model: "shapes-llava", messages: imageMessage("Hi"), max_tokens: 4 }, 503);
  let finish = null;
  for (let c = await it.next(); !c.done; c = await it.next()) {
    if (c.value.choices[0]?.finish_reason) finish = c.value.choices[0].finish_reason;
  }
  assert.equal(finish, "length");
});

server.proc.kill("SIGKILL");
if (failures.length) {
  console.log(`\n${failures.length} failed:\n  ${failures.join("\n  ")}\n--- server log ---\n${server.log().slice(-4000)}`);
  process.exit(1);
}
console.log("all passed");
process.exit(0);
