#!/usr/bin/env node
// An omni-core worker in JavaScript, on Node's standard library alone (net, crypto): what a
// worker in another language needs to pass `omni-core conformance --worker cmd:...`.
//
//   node worker.js --address ipc:///path --rank R --epoch E [--bug NAME] [--fail-start]
//
// It speaks ZeroMQ's wire protocol (ZMTP 3.0, NULL mechanism, a DEALER socket) itself, so no
// native zeromq binding is needed, and msgpack (the protocol's encoding) by hand. Its model is
// simulated in host memory: two tagged pools (weights, kv_cache) as Buffers, level 1 keeps a
// host copy of the weights, level 2 discards them until ReloadWeights. It declares 'transfer'
// and answers the transfer commands (P-22), holding nothing: it exports and imports no tensor.
// `--bug NAME` plants one of the faults in BUGS (the conformance tests' mutant corpus);
// `--fail-start` greets in FAILED.
"use strict";

const crypto = require("crypto");
const net = require("net");

const PROTOCOL_VERSION = 1;
const MAX_FRAME_BYTES = 64 << 20;
const MAX_TASK_ID_CHARS = 128;
const MAX_TAGS = 64;
const MAX_LINKS = 8; // a link plan's paths (P-18)
const MAX_DEVICE_INDEX = 63;
const MAX_LINK_SHARE = 1000;
const MAX_DEPTH = 64;
const MAX_EPOCH_AHEAD = 64n;
const MAX_DETAIL_CHARS = 4096;
const MAX_MEMORY_WAIT_S = 3600; // Wake.memory_wait_s (P-16)
const TAGS = ["weights", "kv_cache"];
const POOL_BYTES = { weights: 256 << 10, kv_cache: 64 << 10 };
// 'transfer' (P-22): it answers the transfer commands, though its connector exports and
// imports no name (its model computes nothing for another stage): each is refused as P-22 says.
const CAPABILITIES = ["level2", "partial_wake", "transfer"];
const NO_LINKS = "this worker copies over its own host link only (capability 'multi_path' not declared); " +
  "send the command without links";
const SOURCE = "none: no GPU (node.js worker, host memory only)";
const BUGS = new Set(["tiny_reply_cache", "wake_unknown_tag_already", "crash_on_shutdown_asleep"]);
const IDLE = ["ACTIVE", "SLEEPING", "PARTIAL", "NEEDS_RELOAD"];
// The transfer commands' bounds (P-22), as the schema states them; a source's buckets as P-17's.
const MAX_TRANSFER_BYTES = 1n << 36n;
const DEFAULT_TRANSFER_BYTES = 1n << 30n;
const MAX_TRANSFER_NAMES = 16;
const MAX_BUCKET_BYTES = 1n << 40n;
const MAX_WEIGHTS_VERSION = (1n << 63n) - 1n;
const MAX_BUCKETS = 4096;
const MAX_BUCKET_TENSORS = 16384;
const MAX_TENSOR_DIMS = 8;
const MAX_DIM = 1n << 40n;
const MAX_TENSOR_NAME_CHARS = 256;
const MAX_HANDLE_CHARS = 4096;
const DTYPE_BYTES = { float32: 4n, float16: 2n, bfloat16: 2n, float64: 8n, int64: 8n, int32: 4n, int16: 2n, int8: 1n,
  uint8: 1n, bool: 1n, float8_e4m3fn: 1n, float8_e5m2: 1n };
const REQUEST_ID_RE = /^[A-Za-z0-9_.:/-]+$/;
const CONNECTOR_NAME_RE = /^[a-z][a-z0-9_]*$/;

// ---------------------------------------------------------------- arguments

function parseArgs(argv) {
  const out = { bug: "", failStart: false };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--fail-start") out.failStart = true;
    else if (["--address", "--rank", "--epoch", "--bug"].includes(a) && i + 1 < argv.length) out[a.slice(2)] = argv[++i];
    else throw new Error(`unknown argument ${JSON.stringify(a)}; usage: worker.js --address A --rank R --epoch E`);
  }
  if (!out.address || !out.address.startsWith("ipc://") || out.rank === undefined) {
    throw new Error("--address ipc://PATH and --rank N are required");
  }
  if (out.bug && !BUGS.has(out.bug)) throw new Error(`unknown bug ${out.bug}; known: ${[...BUGS].join(", ")}`);
  return { ...out, rank: Number(out.rank), epoch: BigInt(out.epoch || 0) };
}

// ---------------------------------------------------------------- msgpack

class Float { constructor(value) { this.value = value; } } // always encoded as float64

class DecodeError extends Error {}

const utf8 = new TextDecoder("utf-8", { fatal: true });

function decodeMsgpack(buf) {
  let pos = 0;
  const need = (n) => { if (pos + n > buf.length) throw new DecodeError("truncated msgpack"); };
  const str = (n) => {
    need(n);
    const bytes = buf.subarray(pos, pos + n);
    pos += n;
    try { return utf8.decode(bytes); } catch { throw new DecodeError("a string is not valid UTF-8"); }
  };
  const bin = (n) => { need(n); const b = Buffer.from(buf.subarray(pos, pos + n)); pos += n; return b; };
  const int = (v) => (typeof v === "bigint" && v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v);
  function value(depth) {
    if (depth > MAX_DEPTH) throw new DecodeError("nesting too deep");
    need(1);
    const b = buf[pos++];
    if (b <= 0x7f) return b;
    if (b >= 0xe0) return b - 0x100;
    if ((b & 0xe0) === 0xa0) return str(b & 0x1f);
    if ((b & 0xf0) === 0x90) return array(b & 0x0f, depth);
    if ((b & 0xf0) === 0x80) return map(b & 0x0f, depth);
    const u = (n) => { need(n); const v = buf.readUIntBE(pos, n); pos += n; return v; };
    switch (b) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return bin(u(1));
      case 0xc5: return bin(u(2));
      case 0xc6: return bin(u(4));
      case 0xca: need(4); pos += 4; return new Float(buf.readFloatBE(pos - 4));
      case 0xcb: need(8); pos += 8; return new Float(buf.readDoubleBE(pos - 8));
      case 0xcc: return u(1);
      case 0xcd: return u(2);
      case 0xce: return u(4);
      case 0xcf: need(8); pos += 8; return int(buf.readBigUInt64BE(pos - 8));
      case 0xd0: need(1); pos += 1; return buf.readInt8(pos - 1);
      case 0xd1: need(2); pos += 2; return buf.readInt16BE(pos - 2);
      case 0xd2: need(4); pos += 4; return buf.readInt32BE(pos - 4);
      case 0xd3: need(8); pos += 8; return int(buf.readBigInt64BE(pos - 8));
      case 0xd9: return str(u(1));
      case 0xda: return str(u(2));
      case 0xdb: return str(u(4));
      case 0xdc: return array(u(2), depth);
      case 0xdd: return array(u(4), depth);
      case 0xde: return map(u(2), depth);
      case 0xdf: return map(u(4), depth);
      default: throw new DecodeError(`msgpack type byte 0x${b.toString(16)} is not accepted`);
    }
  }
  function array(n, depth) {
    if (n > buf.length - pos) throw new DecodeError("truncated msgpack");
    const out = [];
    for (let i = 0; i < n; i++) out.push(value(depth + 1));
    return out;
  }
  function map(n, depth) {
    if (n > buf.length - pos) throw new DecodeError("truncated msgpack");
    const out = new Map();
    for (let i = 0; i < n; i++) {
      const k = value(depth + 1);
      out.set(k, value(depth + 1));
    }
    return out;
  }
  const result = value(0);
  if (pos !== buf.length) throw new DecodeError(`${buf.length - pos} bytes after the message`);
  return result;
}

function encodeMsgpack(v) {
  const parts = [];
  const head = (bytes) => parts.push(Buffer.from(bytes));
  function uint(n, small, b8, b16, b32) {
    if (n < 256) head([b8, n]);
    else if (n < 65536) head([b16, n >> 8, n & 0xff]);
    else { const b = Buffer.alloc(5); b[0] = b32; b.writeUInt32BE(n, 1); parts.push(b); }
  }
  function enc(x) {
    if (x === null || x === undefined) head([0xc0]);
    else if (x === true) head([0xc3]);
    else if (x === false) head([0xc2]);
    else if (x instanceof Float) { const b = Buffer.alloc(9); b[0] = 0xcb; b.writeDoubleBE(x.value, 1); parts.push(b); }
    else if (typeof x === "bigint" || (typeof x === "number" && Number.isInteger(x))) {
      const n = BigInt(x);
      if (n >= 0n && n < 128n) head([Number(n)]);
      else if (n < 0n && n >= -32n) head([Number(n) & 0xff]);
      else if (n >= 0n) { const b = Buffer.alloc(9); b[0] = 0xcf; b.writeBigUInt64BE(n, 1); parts.push(b); }
      else { const b = Buffer.alloc(9); b[0] = 0xd3; b.writeBigInt64BE(n, 1); parts.push(b); }
    } else if (typeof x === "number") enc(new Float(x));
    else if (typeof x === "string") {
      const b = Buffer.from(x, "utf8");
      if (b.length < 32) head([0xa0 | b.length]); else uint(b.length, false, 0xd9, 0xda, 0xdb);
      parts.push(b);
    } else if (Buffer.isBuffer(x)) { uint(x.length, false, 0xc4, 0xc5, 0xc6); parts.push(x); }
    else if (Array.isArray(x)) {
      if (x.length < 16) head([0x90 | x.length]); else if (x.length < 65536) head([0xdc, x.length >> 8, x.length & 0xff]);
      else { const b = Buffer.alloc(5); b[0] = 0xdd; b.writeUInt32BE(x.length, 1); parts.push(b); }
      x.forEach(enc);
    } else {
      const entries = x instanceof Map ? [...x.entries()] : Object.entries(x);
      if (entries.length < 16) head([0x80 | entries.length]); else head([0xde, entries.length >> 8, entries.length & 0xff]);
      for (const [k, val] of entries) { enc(k); enc(val); }
    }
  }
  enc(v);
  return Buffer.concat(parts);
}

// ---------------------------------------------------------------- commands: strict schema

class BadMessage extends Error {
  constructor(detail, { reason = "BAD_MESSAGE", taskId = null, epoch = null } = {}) {
    super(detail);
    Object.assign(this, { detail, reason, taskId, epoch });
  }
}

const COMMAND_FIELDS = {
  Sleep: ["level", "tags", "links"], Wake: ["tags", "memory_wait_s", "links"], ReloadWeights: ["source"], Execute: ["payload"], Status: [], Shutdown: [],
  ResetPrefixCache: [], HoldRequests: ["hold", "clear_cache"],
  TransferOut: ["request_id", "names", "payload", "max_bytes", "bucket_bytes"],
  TransferIn: ["request_id", "producer_version", "source", "expect_version", "max_bytes"],
  TransferRelease: ["request_id"],
};
const REPLY_TYPES = ["Ack", "Nack", "Result", "Hello"];
const TAG_RE = /^[A-Za-z0-9_.-]+$/;

const isInt = (x) => typeof x === "bigint" || (typeof x === "number" && Number.isInteger(x));
const readableTaskId = (t) => (typeof t === "string" && t.length > 0 && t.length <= MAX_TASK_ID_CHARS ? t : null);
const readableEpoch = (e) => (isInt(e) && BigInt(e) >= 0n && BigInt(e) < 2n ** 64n ? BigInt(e) : null);

// P-18: a link plan, checked as the schema checks it; this worker copies over no link but its
// own (it does not declare 'multi_path'), so a valid plan is refused later as UNSUPPORTED.
function parseLinks(links, type, ids) {
  const number = (x) => (x instanceof Float ? x.value : isInt(x) ? Number(x) : NaN);
  const valid = (p) => p instanceof Map && [...p.keys()].every((k) => k === "peer" || k === "share") &&
    (!p.has("peer") || p.get("peer") === null || (isInt(p.get("peer")) && Number(p.get("peer")) >= 0 &&
      Number(p.get("peer")) <= MAX_DEVICE_INDEX)) &&
    (!p.has("share") || (number(p.get("share")) > 0 && number(p.get("share")) <= MAX_LINK_SHARE));
  if (!(Array.isArray(links) && links.length <= MAX_LINKS && links.every(valid))) {
    throw new BadMessage(`invalid ${type}: links must be at most ${MAX_LINKS} paths {peer, share}`, ids);
  }
  return links.map((p) => ({ peer: p.has("peer") ? p.get("peer") : null, share: p.has("share") ? number(p.get("share")) : 1 }));
}

// P-22: an integer within [lo, hi], as a BigInt (versions and byte counts pass 2**53), or null.
const intIn = (x, lo, hi) => (isInt(x) && BigInt(x) >= lo && BigInt(x) <= hi ? BigInt(x) : null);

function only(m, keys, what, ids) {
  if (!(m instanceof Map)) throw new BadMessage(`invalid ${what}: must be a map`, ids);
  for (const k of m.keys()) {
    if (!keys.includes(k)) throw new BadMessage(`invalid ${what}: unknown field ${JSON.stringify(String(k))}`, ids);
  }
}

// One tensor of a bucket: {name, dtype, shape, offset_bytes}; its bytes as a BigInt.
function parseTensorSpec(t, bucketBytes, ids) {
  only(t, ["name", "dtype", "shape", "offset_bytes"], "TransferIn: a tensor", ids);
  const name = t.get("name");
  const dtype = t.get("dtype");
  const shape = t.get("shape");
  const offset = t.has("offset_bytes") ? intIn(t.get("offset_bytes"), 0n, MAX_BUCKET_BYTES) : 0n;
  if (typeof name !== "string" || name.length < 1 || name.length > MAX_TENSOR_NAME_CHARS || !(dtype in DTYPE_BYTES) ||
      !Array.isArray(shape) || shape.length > MAX_TENSOR_DIMS || offset === null) {
    throw new BadMessage(`invalid TransferIn: a tensor needs a name of 1-${MAX_TENSOR_NAME_CHARS} characters, a dtype of ` +
      `${Object.keys(DTYPE_BYTES).join(", ")}, at most ${MAX_TENSOR_DIMS} dimensions and an offset_bytes >= 0`, ids);
  }
  let count = 1n;
  for (const d of shape) {
    const dim = intIn(d, 0n, MAX_DIM);
    if (dim === null) throw new BadMessage(`invalid TransferIn: tensor ${JSON.stringify(name)} has a dimension out of range`, ids);
    count *= dim;
  }
  const nbytes = count * DTYPE_BYTES[dtype];
  if (offset + nbytes > bucketBytes) {
    throw new BadMessage(`invalid TransferIn: tensor ${JSON.stringify(name)} (${nbytes} bytes at offset ${offset}) ` +
      `ends past its bucket of ${bucketBytes} bytes`, ids);
  }
  return { spec: { name, dtype, shape: shape.map((d) => BigInt(d)), offset_bytes: offset }, nbytes };
}

// A TransferIn's source: {type: "shm" | "ipc", buckets: [...]}, every bucket's tensors inside
// it, each name once. This worker opens no handle (its connector imports nothing), so a CUDA
// IPC handle is read only as far as its size; the rest is a map it never looks into.
function parseSource(src, ids) {
  const kind = src instanceof Map ? src.get("type") : undefined;
  if (kind !== "shm" && kind !== "ipc") {
    throw new BadMessage('invalid TransferIn: source must be {"type": "shm" | "ipc", "buckets": [...]}', ids);
  }
  only(src, ["type", "buckets"], "TransferIn: source", ids);
  const buckets = src.get("buckets");
  if (!Array.isArray(buckets) || buckets.length < 1 || buckets.length > MAX_BUCKETS) {
    throw new BadMessage(`invalid TransferIn: a source has 1-${MAX_BUCKETS} buckets`, ids);
  }
  const names = new Set();
  let carried = 0n;
  const parsed = buckets.map((b) => {
    only(b, kind === "shm" ? ["handle", "nbytes", "sender_pid", "tensors"] : ["nbytes", "sender_pid", "tensors", "ipc", "handle"],
      `TransferIn: a ${kind} bucket`, ids);
    const nbytes = intIn(b.get("nbytes"), 0n, MAX_BUCKET_BYTES);
    const pid = intIn(b.get("sender_pid"), 1n, (1n << 31n) - 1n);
    const tensors = b.get("tensors");
    const handle = b.has("handle") ? b.get("handle") : null;
    const handleOk = kind === "shm"
      ? typeof handle === "string" && handle.length >= 1 && handle.length <= MAX_HANDLE_CHARS
      : handle === null; // an ipc bucket's handle exists only to refuse the old pickled form
    const ipc = b.get("ipc");
    const ipcOk = kind === "shm" ||
      (ipc instanceof Map && nbytes !== null && intIn(ipc.get("size"), nbytes, MAX_BUCKET_BYTES) !== null);
    if (nbytes === null || pid === null || !handleOk || !ipcOk || !Array.isArray(tensors) || tensors.length < 1 ||
        tensors.length > MAX_BUCKET_TENSORS) {
      throw new BadMessage(`invalid TransferIn: a ${kind} bucket needs ${kind === "shm" ? "a handle, " : "its ipc handle (of at least " +
        "its nbytes), "}nbytes, sender_pid and 1-${MAX_BUCKET_TENSORS} tensors`, ids);
    }
    const specs = tensors.map((t) => {
      const { spec, nbytes: size } = parseTensorSpec(t, nbytes, ids);
      if (names.has(spec.name)) throw new BadMessage(`invalid TransferIn: tensor ${JSON.stringify(spec.name)} is named twice`, ids);
      names.add(spec.name);
      carried += size;
      return spec;
    });
    return { nbytes, sender_pid: pid, tensors: specs, ...(kind === "shm" ? { handle } : {}) };
  });
  return { source: { type: kind, buckets: parsed }, names: [...names], carried };
}

// TransferOut, TransferIn, TransferRelease (P-22): their fields into `cmd`, bounded as the schema is.
function parseTransfer(m, type, ids, cmd) {
  const request = m.get("request_id");
  if (typeof request !== "string" || request.length > MAX_TASK_ID_CHARS || !REQUEST_ID_RE.test(request)) {
    throw new BadMessage(`invalid ${type}: request_id must be 1-${MAX_TASK_ID_CHARS} characters of [A-Za-z0-9_.:/-]`, ids);
  }
  cmd.request_id = request;
  if (type === "TransferRelease") return;
  const maxBytes = m.has("max_bytes") ? intIn(m.get("max_bytes"), 1n, MAX_TRANSFER_BYTES) : DEFAULT_TRANSFER_BYTES;
  if (maxBytes === null) throw new BadMessage(`invalid ${type}: max_bytes must be an integer in 1..${MAX_TRANSFER_BYTES}`, ids);
  cmd.max_bytes = maxBytes;
  if (type === "TransferOut") {
    const names = m.get("names");
    if (!Array.isArray(names) || names.length < 1 || names.length > MAX_TRANSFER_NAMES ||
        !names.every((n) => typeof n === "string" && n.length <= 64 && CONNECTOR_NAME_RE.test(n))) {
      throw new BadMessage(`invalid TransferOut: names must be 1-${MAX_TRANSFER_NAMES} connector names ([a-z][a-z0-9_]*)`, ids);
    }
    const bucketBytes = m.has("bucket_bytes") ? intIn(m.get("bucket_bytes"), 1n, MAX_BUCKET_BYTES) : 256n << 20n;
    if (bucketBytes === null) throw new BadMessage(`invalid TransferOut: bucket_bytes must be in 1..${MAX_BUCKET_BYTES}`, ids);
    Object.assign(cmd, { names, payload: m.has("payload") ? m.get("payload") : null, bucket_bytes: bucketBytes });
    return;
  }
  const producer = intIn(m.get("producer_version"), 0n, MAX_WEIGHTS_VERSION);
  const declared = m.has("expect_version") ? m.get("expect_version") : null; // null: any version
  const expect = declared === null ? undefined : intIn(declared, 0n, MAX_WEIGHTS_VERSION);
  if (producer === null || expect === null) {
    throw new BadMessage(`invalid TransferIn: producer_version (required) and expect_version must be versions in 0..${MAX_WEIGHTS_VERSION}`, ids);
  }
  const { source, names, carried } = parseSource(m.get("source"), ids);
  if (carried > maxBytes) { // refused on decode (P-22, P-10): nothing about the transfer is looked at
    throw new BadMessage(`invalid TransferIn: the transfer carries ${carried} bytes, over its max_bytes ${maxBytes}; ` +
      "raise max_bytes or export fewer tensors", ids);
  }
  Object.assign(cmd, { producer_version: producer, expect_version: expect === undefined ? null : expect, source, names });
}

function parseCommand(data) {
  let m;
  try { m = decodeMsgpack(data); } catch (e) {
    if (e instanceof DecodeError) throw new BadMessage(`undecodable message (${data.length} bytes): ${e.message}`);
    throw e;
  }
  if (!(m instanceof Map)) throw new BadMessage("a message must be a msgpack map");
  const taskId = readableTaskId(m.get("task_id"));
  const epoch = readableEpoch(m.get("epoch"));
  const ids = { taskId, epoch };
  const v = m.has("v") ? m.get("v") : PROTOCOL_VERSION;
  if (isInt(v) && Number(v) !== PROTOCOL_VERSION) {
    throw new BadMessage(`protocol version ${v} is not supported: this peer speaks version ${PROTOCOL_VERSION}; ` +
      "run the same omni-core protocol version on both ends", { ...ids, reason: "UNSUPPORTED_VERSION" });
  }
  const type = m.get("type");
  if (REPLY_TYPES.includes(type)) throw new BadMessage(`a worker accepts only commands, got a ${type} reply`, ids);
  if (typeof type !== "string" || !(type in COMMAND_FIELDS)) throw new BadMessage("invalid message: unknown or missing type", ids);
  const allowed = new Set(["type", "v", "task_id", "epoch", ...COMMAND_FIELDS[type]]);
  for (const k of m.keys()) if (!allowed.has(k)) throw new BadMessage(`invalid ${type}: unknown field ${JSON.stringify(String(k))}`, ids);
  if (!isInt(v)) throw new BadMessage(`invalid ${type}: v must be an integer`, ids);
  if (taskId === null) throw new BadMessage(`invalid ${type}: task_id must be a string of 1-${MAX_TASK_ID_CHARS} characters`, ids);
  if (epoch === null) throw new BadMessage(`invalid ${type}: epoch must be an integer >= 0`, ids);
  const cmd = { type, task_id: taskId, epoch };
  if (type === "Sleep") {
    const level = m.has("level") ? m.get("level") : 1;
    if (level !== 1 && level !== 2) throw new BadMessage(`invalid Sleep: level must be 1 or 2, got ${level}`, ids);
    cmd.level = level;
  }
  if (type === "Sleep" || type === "Wake") {
    const tags = m.has("tags") ? m.get("tags") : null;
    if (tags !== null && !(Array.isArray(tags) && tags.length >= 1 && tags.length <= MAX_TAGS &&
        tags.every((t) => typeof t === "string" && t.length <= 64 && TAG_RE.test(t)))) {
      throw new BadMessage(`invalid ${type}: tags must be null or 1-${MAX_TAGS} tag names`, ids);
    }
    cmd.tags = tags;
    const links = parseLinks(m.has("links") ? m.get("links") : [], type, ids);
    if (links.length) cmd.links = links; // left out when empty, like the wire: the v1 digest is unchanged
  }
  if (type === "Wake") {
    // P-16: how long the wake may wait for free device memory. This worker holds no device
    // memory and does not declare 'swap': it reads the field only to refuse a wait > 0.
    const raw = m.has("memory_wait_s") ? m.get("memory_wait_s") : 0;
    const wait = raw instanceof Float ? raw.value : isInt(raw) ? Number(raw) : NaN;
    if (!(wait >= 0 && wait <= MAX_MEMORY_WAIT_S)) {
      throw new BadMessage(`invalid Wake: memory_wait_s must be a number of seconds in 0..${MAX_MEMORY_WAIT_S}`, ids);
    }
    if (wait > 0) cmd.memory_wait_s = wait; // left out at 0, like the wire: the v1 digest is unchanged
  }
  if (type === "ReloadWeights") {
    const source = m.has("source") ? m.get("source") : null;
    if (source !== null && typeof source !== "string") throw new BadMessage("invalid ReloadWeights: source must be a string or null", ids);
    cmd.source = source;
  }
  if (type === "Execute") cmd.payload = m.has("payload") ? m.get("payload") : null;
  if (type === "HoldRequests") {
    // P-23: hold is required, clear_cache defaults to false; both are booleans.
    const clear = m.has("clear_cache") ? m.get("clear_cache") : false;
    if (typeof m.get("hold") !== "boolean" || typeof clear !== "boolean") {
      throw new BadMessage("invalid HoldRequests: hold (required) and clear_cache must be booleans", ids);
    }
    cmd.hold = m.get("hold");
    cmd.clear_cache = clear;
  }
  if (type.startsWith("Transfer")) parseTransfer(m, type, ids, cmd);
  return cmd;
}

// The digest of a command, epoch left out (a retry across an epoch bump is the same command).
function digest(cmd) {
  const { epoch, ...rest } = cmd;
  return crypto.createHash("sha256").update(encodeMsgpack(JSON.parse(JSON.stringify(rest, (k, x) =>
    (typeof x === "bigint" ? x.toString() : x instanceof Float ? x.value : Buffer.isBuffer(x) ? x.toString("hex") :
      x instanceof Map ? Object.fromEntries(x) : x))))).digest("hex");
}

// ---------------------------------------------------------------- the worker

class Worker {
  constructor(args, send, exit) {
    this.rank = args.rank;
    this.epoch = args.epoch;
    this.bug = args.bug;
    this.send = send; // (Buffer) => void
    this.exit = exit;
    this.state = args.failStart ? "FAILED" : "ACTIVE";
    this.failure = args.failStart ? "load failed: --fail-start (a model that could not be loaded)" : "";
    this.asleep = new Set();
    this.weightsValid = true;
    this.pools = args.failStart ? {} : Object.fromEntries(TAGS.map((t) => [t, Buffer.alloc(POOL_BYTES[t])]));
    this.hostCopy = null; // the weights a level-1 sleep offloaded
    this.held = false; // HoldRequests (P-23): held until a release, though nothing ever runs to hold
    this.cache = new Map(); // task_id -> {digest, name, reply}, oldest first
    this.cacheEntries = this.bug === "tiny_reply_cache" ? 4 : 1024;
    if (!args.failStart) this.fillWeights(7);
  }

  fillWeights(seed) {
    const w = this.pools.weights;
    let x = seed >>> 0;
    for (let i = 0; i < w.length; i++) { x = (Math.imul(x, 1103515245) + 12345) >>> 0; w[i] = x >>> 24; }
  }

  usage() {
    return Object.fromEntries(TAGS.map((t) => [t, this.pools[t] ? this.pools[t].length : 0]));
  }

  memory(before) {
    return { pool_bytes_before: before, pool_bytes_after: this.usage(), process_bytes_before: null,
      process_bytes_after: null, process_bytes_source: SOURCE };
  }

  detail(text) {
    const full = this.failure && !text.includes(this.failure) ? `${text}; worker failed earlier: ${this.failure}` : text;
    return full.slice(0, MAX_DETAIL_CHARS);
  }

  ack(cmd, status, memory = null, started = null) {
    const duration = started === null ? 0 : Number(process.hrtime.bigint() - started) / 1e9;
    return { type: "Ack", v: PROTOCOL_VERSION, task_id: cmd.task_id, epoch: this.epoch, rank: this.rank,
      command: cmd.type, state: this.state, status, asleep_tags: [...this.asleep].sort(), memory,
      duration_s: new Float(duration), detail: this.failure };
  }

  nack(cmd, reason, detail) {
    return { type: "Nack", v: PROTOCOL_VERSION, task_id: cmd.task_id, epoch: cmd.epoch, rank: this.rank,
      command: cmd.type, reason, detail: this.detail(detail), state: this.state };
  }

  reply(message) { const data = encodeMsgpack(message); this.send(data); return data; }

  remember(cmd, data) {
    this.cache.set(cmd.task_id, { digest: digest(cmd), name: cmd.type, data });
    while (this.cache.size > this.cacheEntries) this.cache.delete(this.cache.keys().next().value);
  }

  answer(cmd, message) { this.remember(cmd, this.reply(message)); } // a terminal answer, kept for copies

  refuse(cmd, reason, detail) { this.reply(this.nack(cmd, reason, detail)); } // no effect, not kept

  refuseState(cmd, hint = "") {
    const text = `${cmd.type} is not allowed in state ${this.state}`;
    this.refuse(cmd, "INVALID_STATE", hint ? `${text}; ${hint}` : text);
  }

  onBytes(data) {
    let cmd;
    try { cmd = parseCommand(data); } catch (e) {
      if (!(e instanceof BadMessage)) throw e;
      this.reply({ type: "Nack", v: PROTOCOL_VERSION, task_id: e.taskId || "-", epoch: e.epoch === null ? this.epoch : e.epoch,
        rank: this.rank, command: "?", reason: e.reason, detail: this.detail(e.detail), state: this.state });
      return;
    }
    this.onCommand(cmd);
  }

  onCommand(cmd) {
    if (cmd.epoch < this.epoch) {
      return this.refuse(cmd, "STALE_EPOCH", `command epoch ${cmd.epoch} is older than this worker's epoch ${this.epoch}`);
    }
    if (cmd.epoch > this.epoch + MAX_EPOCH_AHEAD) {
      return this.refuse(cmd, "EPOCH_AHEAD", `command epoch ${cmd.epoch} is more than ${MAX_EPOCH_AHEAD} ahead of this ` +
        `worker's epoch ${this.epoch}; restart the rank under the new epoch`);
    }
    this.epoch = cmd.epoch;
    if (cmd.type !== "Status" && this.cache.has(cmd.task_id)) {
      const kept = this.cache.get(cmd.task_id);
      if (kept.digest !== digest(cmd)) {
        return this.refuse(cmd, "TASK_ID_REUSED", `task_id ${JSON.stringify(cmd.task_id)} was already used for a ` +
          `different ${kept.name}; use a fresh task_id per command`);
      }
      this.cache.delete(cmd.task_id); // least recently used goes first
      this.cache.set(cmd.task_id, kept);
      return this.send(kept.data);
    }
    if (this.state === "FAILED" && cmd.type !== "Shutdown" && cmd.type !== "Status") {
      return this.refuse(cmd, "FAILED", `worker is FAILED (${this.failure}); only Shutdown or a restart leaves FAILED`);
    }
    return this[`on${cmd.type}`](cmd);
  }

  resolveTags(cmd) {
    if (cmd.tags === null) return new Set(TAGS);
    let wanted = cmd.tags;
    if (this.bug === "wake_unknown_tag_already" && cmd.type === "Wake") wanted = wanted.filter((t) => TAGS.includes(t));
    const unknown = wanted.filter((t) => !TAGS.includes(t));
    if (unknown.length) {
      this.refuse(cmd, "UNKNOWN_TAG", `unknown tag(s) ${JSON.stringify(unknown)}; this worker has tags ${JSON.stringify(TAGS)}`);
      return null;
    }
    return new Set(wanted);
  }

  settle() {
    if (this.asleep.size === 0 && this.weightsValid) return "ACTIVE";
    if (!this.asleep.has("weights") && !this.weightsValid) return "NEEDS_RELOAD";
    return "PARTIAL";
  }

  onSleep(cmd) {
    const tags = this.resolveTags(cmd);
    if (tags === null) return undefined;
    if (cmd.links) return this.refuse(cmd, "UNSUPPORTED", NO_LINKS);
    const toSleep = [...tags].filter((t) => !this.asleep.has(t));
    if (!toSleep.length && ["SLEEPING", "PARTIAL", "NEEDS_RELOAD"].includes(this.state)) {
      return this.answer(cmd, this.ack(cmd, "ALREADY"));
    }
    if (!IDLE.includes(this.state)) return this.refuseState(cmd);
    const started = process.hrtime.bigint();
    const before = this.usage();
    for (const tag of toSleep) {
      if (tag === "weights" && cmd.level === 1 && this.weightsValid) this.hostCopy = Buffer.from(this.pools.weights);
      if (tag === "weights" && cmd.level === 2) this.weightsValid = false;
      this.pools[tag] = null; // released: the pool holds nothing now
      this.asleep.add(tag);
    }
    this.state = "SLEEPING";
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(before), started));
  }

  onWake(cmd) {
    const tags = this.resolveTags(cmd);
    if (tags === null) return undefined;
    const toWake = [...tags].filter((t) => this.asleep.has(t));
    if (!toWake.length && IDLE.includes(this.state)) return this.answer(cmd, this.ack(cmd, "ALREADY"));
    if (toWake.length !== this.asleep.size && !CAPABILITIES.includes("partial_wake")) {
      return this.refuse(cmd, "UNSUPPORTED", "this worker does not support partial wake");
    }
    if (cmd.links) return this.refuse(cmd, "UNSUPPORTED", NO_LINKS);
    if (cmd.memory_wait_s && !CAPABILITIES.includes("swap")) {
      return this.refuse(cmd, "UNSUPPORTED", "this worker cannot wait for free device memory (capability 'swap' " +
        "not declared); send the Wake with memory_wait_s=0");
    }
    if (!["SLEEPING", "PARTIAL", "NEEDS_RELOAD"].includes(this.state)) return this.refuseState(cmd);
    const started = process.hrtime.bigint();
    const before = this.usage();
    for (const tag of toWake) {
      const restored = Buffer.alloc(POOL_BYTES[tag]);
      if (tag === "weights" && this.weightsValid && this.hostCopy) { this.hostCopy.copy(restored); this.hostCopy = null; }
      this.pools[tag] = restored;
      this.asleep.delete(tag);
    }
    this.state = this.settle();
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(before), started));
  }

  onReloadWeights(cmd) {
    if (this.state !== "NEEDS_RELOAD" && this.state !== "ACTIVE") {
      return this.refuseState(cmd, "ReloadWeights needs NEEDS_RELOAD (after a level-2 sleep and a wake) or ACTIVE");
    }
    if (cmd.source !== null && !/^[0-9]{1,9}$/.test(cmd.source)) {
      // Refused before anything is written; kept, like any answer to an attempted effect.
      return this.answer(cmd, this.nack(cmd, "INVALID_ARGUMENT", `ReloadWeights task ${JSON.stringify(cmd.task_id)} ` +
        "refused, nothing was written: this model reloads from a decimal seed (or null for its own)"));
    }
    const started = process.hrtime.bigint();
    const before = this.usage();
    this.fillWeights(cmd.source === null ? 7 : Number(cmd.source));
    this.weightsValid = true;
    this.state = this.settle();
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(before), started));
  }

  onExecute(cmd) {
    if (this.state !== "ACTIVE") {
      return this.refuseState(cmd, "Execute runs only in ACTIVE, where every tag is resident and the weights are valid");
    }
    const started = process.hrtime.bigint();
    const p = cmd.payload;
    if (!(p instanceof Map) || !isInt(p.get("seed")) || !isInt(p.get("batch"))) {
      return this.answer(cmd, this.nack(cmd, "EXECUTE_ERROR", `Execute task ${JSON.stringify(cmd.task_id)} failed: ` +
        'the payload must be a map {"seed": int, "batch": int}'));
    }
    let sum = Number(BigInt(p.get("seed")) % 65521n);
    for (const byte of this.pools.weights) sum = (sum * 31 + byte) % 1000000007;
    const duration = Number(process.hrtime.bigint() - started) / 1e9;
    return this.answer(cmd, { type: "Result", v: PROTOCOL_VERSION, task_id: cmd.task_id, epoch: this.epoch, rank: this.rank,
      output: { checksum: sum, batch: p.get("batch") }, duration_s: new Float(duration) });
  }

  onResetPrefixCache(cmd) {
    // P-19: this worker caches nothing across requests, so there is nothing to drop; no pool moves.
    if (this.state !== "ACTIVE" && this.state !== "PARTIAL") {
      return this.refuseState(cmd, "ResetPrefixCache needs the weights and caches resident: ACTIVE or PARTIAL");
    }
    const started = process.hrtime.bigint();
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(this.usage()), started));
  }

  onHoldRequests(cmd) {
    // P-23, pause mode keep. This worker answers each Execute as it arrives, so no request is
    // running when a hold comes (a runner that cannot freeze: they are all answered first):
    // the hold holds nothing, and nothing moves.
    if (this.state !== "ACTIVE") return this.refuseState(cmd, "requests are held and released in ACTIVE, where they run");
    if (cmd.hold === this.held) return this.answer(cmd, this.ack(cmd, "ALREADY"));
    const started = process.hrtime.bigint();
    this.held = cmd.hold;
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(this.usage()), started));
  }

  // P-22. Nothing is ever held here for a request: the connector exports and imports no name,
  // so every export and every landing is refused (kept, like any answer to an attempted effect).
  onTransferOut(cmd) {
    if (this.state !== "ACTIVE") return this.refuseState(cmd, "TransferOut runs the model's export: ACTIVE only");
    return this.answer(cmd, this.nack(cmd, "INVALID_ARGUMENT", `the export of request ${JSON.stringify(cmd.request_id)}: ` +
      `${JSON.stringify(cmd.names)} are not exported by this worker, whose model exports nothing; nothing held`));
  }

  onTransferIn(cmd) {
    if (this.state !== "ACTIVE") return this.refuseState(cmd, "TransferIn is taken only where its request can run: ACTIVE");
    const what = `the transfer of request ${JSON.stringify(cmd.request_id)}`;
    if (cmd.expect_version !== null && cmd.expect_version !== cmd.producer_version) {
      return this.answer(cmd, this.nack(cmd, "INVALID_ARGUMENT", `${what} carries producer weights version ` +
        `${cmd.producer_version}, its request was declared for version ${cmd.expect_version}; nothing was kept`));
    }
    return this.answer(cmd, this.nack(cmd, "INVALID_ARGUMENT", `${what}: ${JSON.stringify(cmd.names)} are not among ` +
      "this worker's imports (its model imports nothing); no handle was opened, nothing was kept"));
  }

  onTransferRelease(cmd) {
    if (!IDLE.includes(this.state)) {
      return this.refuseState(cmd, "TransferRelease is taken in ACTIVE, SLEEPING, PARTIAL and NEEDS_RELOAD");
    }
    // Nothing held for the request: acknowledged as a release of a hold would be (P-22).
    const started = process.hrtime.bigint();
    return this.answer(cmd, this.ack(cmd, "OK", this.memory(this.usage()), started));
  }

  onStatus(cmd) {
    const before = this.usage();
    this.reply(this.ack(cmd, "OK", this.memory(before))); // never kept: it reports, it changes nothing
  }

  onShutdown(cmd) {
    if (this.state === "STOPPED") return this.answer(cmd, this.ack(cmd, "ALREADY"));
    if (this.bug === "crash_on_shutdown_asleep" && this.asleep.size) process.exit(139); // frees the host copy twice
    const started = process.hrtime.bigint();
    const before = this.usage();
    for (const tag of TAGS) this.pools[tag] = null;
    this.hostCopy = null;
    this.state = "STOPPED";
    this.answer(cmd, this.ack(cmd, "OK", this.memory(before), started));
    return this.exit(0);
  }
}

// ---------------------------------------------------------------- ZMTP 3.0, a DEALER socket

const GREETING_BYTES = 64;

function greeting() {
  const g = Buffer.alloc(GREETING_BYTES);
  g[0] = 0xff; g[8] = 0x01; g[9] = 0x7f; // signature
  g[10] = 3; g[11] = 0; // version 3.0
  g.write("NULL", 12, "ascii"); // mechanism, zero-padded to 20 bytes; as-server 0; filler
  return g;
}

function frame(body, { command = false } = {}) {
  const long = body.length > 255;
  const head = Buffer.alloc(long ? 9 : 2);
  head[0] = (command ? 0x04 : 0) | (long ? 0x02 : 0);
  if (long) head.writeBigUInt64BE(BigInt(body.length), 1); else head[1] = body.length;
  return Buffer.concat([head, body]);
}

function ready(identity) {
  const prop = (name, value) => {
    const n = Buffer.from(name, "ascii");
    const len = Buffer.alloc(4);
    len.writeUInt32BE(value.length);
    return Buffer.concat([Buffer.from([n.length]), n, len, value]);
  };
  return frame(Buffer.concat([Buffer.from([5]), Buffer.from("READY", "ascii"),
    prop("Socket-Type", Buffer.from("DEALER")), prop("Identity", identity)]), { command: true });
}

// Reads ZMTP frames from a byte stream; a frame over the limit is skipped as it streams by,
// never held, and its message is reported as oversized (P-13).
class FrameReader {
  constructor(onMessage, onOversized, onGreeting, onReady) {
    Object.assign(this, { onMessage, onOversized, onGreeting, onReady, buf: Buffer.alloc(0), greeted: false, parts: [], skip: 0n,
      skipping: false, oversized: false, more: false });
  }

  push(chunk) {
    this.buf = this.buf.length ? Buffer.concat([this.buf, chunk]) : chunk;
    for (;;) {
      if (this.skip > 0n) {
        const n = this.skip < BigInt(this.buf.length) ? Number(this.skip) : this.buf.length;
        this.buf = this.buf.subarray(n);
        this.skip -= BigInt(n);
        if (this.skip > 0n) return;
        this.endFrame(null);
        continue;
      }
      if (!this.greeted) {
        if (this.buf.length < GREETING_BYTES) return;
        if (this.buf[0] !== 0xff || this.buf[9] !== 0x7f || this.buf[10] < 3) throw new Error("peer is not ZMTP 3");
        this.buf = this.buf.subarray(GREETING_BYTES);
        this.greeted = true;
        this.onGreeting();
        continue;
      }
      if (this.buf.length < 2) return;
      const flags = this.buf[0];
      const long = (flags & 0x02) !== 0;
      if (this.buf.length < (long ? 9 : 2)) return;
      const size = long ? this.buf.readBigUInt64BE(1) : BigInt(this.buf[1]);
      const headBytes = long ? 9 : 2;
      this.more = (flags & 0x01) !== 0;
      if ((flags & 0x04) === 0 && size > BigInt(MAX_FRAME_BYTES)) {
        this.buf = this.buf.subarray(headBytes);
        this.skip = size;
        this.oversized = true;
        if (size === 0n) this.endFrame(null);
        continue;
      }
      if (BigInt(this.buf.length) < BigInt(headBytes) + size) return;
      const body = this.buf.subarray(headBytes, headBytes + Number(size));
      this.buf = this.buf.subarray(headBytes + Number(size));
      if (flags & 0x04) { // a command: the peer's READY ends the handshake; others (PING) need no answer
        if (body.length >= 6 && body[0] === 5 && body.subarray(1, 6).toString("ascii") === "READY") this.onReady();
        continue;
      }
      this.endFrame(Buffer.from(body));
    }
  }

  endFrame(body) {
    if (body !== null) this.parts.push(body);
    if (this.more) return;
    const parts = this.parts;
    const oversized = this.oversized;
    this.parts = [];
    this.oversized = false;
    if (oversized) this.onOversized();
    else if (parts.length) this.onMessage(parts[parts.length - 1]);
  }
}

function hexToBytes(hex) {
  if (!/^([0-9a-fA-F]{2})*$/.test(hex)) throw new Error("OMNI_CORE_RANK_SECRET must be hex");
  return Buffer.from(hex, "hex");
}

function helloProof(secret, { stage, rank, epoch, pid, identity }) {
  const fields = [Buffer.from("omni-core hello v1"), Buffer.from(stage), Buffer.from(String(rank)),
    Buffer.from(String(epoch)), Buffer.from(String(pid)), identity];
  const mac = crypto.createHmac("sha256", secret);
  for (const f of fields) { const len = Buffer.alloc(4); len.writeUInt32BE(f.length); mac.update(len); mac.update(f); }
  return mac.digest("hex");
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const secretHex = process.env.OMNI_CORE_RANK_SECRET;
  delete process.env.OMNI_CORE_RANK_SECRET; // nothing this process starts inherits it
  const secret = secretHex ? hexToBytes(secretHex) : null;
  const identity = Buffer.from(`conformance/${args.rank}/${crypto.randomBytes(8).toString("hex")}`);
  const sock = net.createConnection(args.address.slice("ipc://".length));
  const send = (data) => { if (!sock.writableEnded) sock.write(frame(data)); };
  // After the frames already received (a second Shutdown gets its ALREADY), flush and leave.
  const exit = (code) => setImmediate(() => sock.end(() => process.exit(code)));
  const worker = new Worker(args, send, exit);
  const stage = "conformance";
  const reader = new FrameReader((data) => worker.onBytes(data), () => worker.reply({
    type: "Nack", v: PROTOCOL_VERSION, task_id: "-", epoch: worker.epoch, rank: worker.rank, command: "?",
    reason: "BAD_MESSAGE", detail: `frame over the limit of ${MAX_FRAME_BYTES} bytes, dropped unread`, state: worker.state }),
  () => sock.write(ready(identity)), () => {
    // The handshake is complete: the first message is the Hello.
    const pid = process.pid;
    send(encodeMsgpack({ type: "Hello", v: PROTOCOL_VERSION, task_id: "hello", epoch: args.epoch, rank: args.rank,
      stage, proof: secret ? helloProof(secret, { stage, rank: args.rank, epoch: args.epoch, pid, identity }) : "",
      pid, device: "cpu", backend: "node-simulated", tags: TAGS, capabilities: CAPABILITIES, state: worker.state,
      detail: worker.failure, pool_bytes: worker.usage() }));  // optional: the pools as loaded
  });
  sock.on("connect", () => sock.write(greeting()));
  sock.on("data", (chunk) => reader.push(chunk));
  sock.on("error", (err) => { console.error(`worker: socket error: ${err.message}`); process.exit(2); });
  sock.on("close", () => {
    if (worker.state !== "STOPPED") console.error(`worker: the orchestrator closed the connection (state ${worker.state}, greeted ${reader.greeted})`);
    process.exit(worker.state === "STOPPED" ? 0 : 3);
  });
}

main();
