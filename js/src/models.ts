/** Values the client returns: sandbox records and the outcome of running code. */

import { TransportError } from './errors.js';

/** A sandbox as the server describes it (`GET /v1/sandboxes/{id}`). */
export interface SandboxInfo {
  id: string;
  template: string;
  state: string;
  createdAt: string | null;
  lastActiveAt: string | null;
  idleTimeoutSeconds: number | null;
  metadata: Record<string, string>;
  /** The sandbox's network mode and its own allowlist entries (docs/network.md). */
  network: NetworkSpec;
}

/** `none` (default), `allowlist` (the server's package indexes plus `allow`) or `outbound`. */
export type NetworkMode = 'none' | 'allowlist' | 'outbound';

export interface NetworkSpec {
  mode: NetworkMode;
  /** `host`, `host:port`, `*.example.org[:port]`; only with `allowlist`. */
  allow: string[];
}

/** One rich output of an execution: a Jupyter MIME bundle (`image/png` is base64 text). */
export interface Result {
  data: Record<string, unknown>;
  metadata: Record<string, unknown>;
  /** True for the value of the cell's last expression, false for `display()` outputs. */
  isMainResult: boolean;
}

/** An exception raised by the code that ran in the sandbox (not a client error). */
export interface ExecutionError {
  name: string;
  value: string;
  traceback: string[];
}

/**
 * Everything one `runCode` call produced. `status` is `ok`, `error` (the code raised, or a bash
 * command exited non-zero), `timeout`, `interrupted`, `restarted` or `kernel_died`.
 */
export interface Execution {
  stdout: string;
  stderr: string;
  results: Result[];
  error: ExecutionError | null;
  executionCount: number | null;
  durationMs: number | null;
  status: string;
  /** A bash command's exit status (null for Python). */
  exitCode: number | null;
  /** True when stdout/stderr went over the server's limit (a marker in the text says where). */
  outputTruncated: boolean;
  /** The `text/plain` of the main result (the cell's value), or null. */
  readonly text: string | null;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function networkFromWire(value: unknown): NetworkSpec {
  if (!isRecord(value)) return { mode: 'none', allow: [] };
  const mode = value.mode === 'allowlist' || value.mode === 'outbound' ? value.mode : 'none';
  const allow = Array.isArray(value.allow) ? value.allow.map(String) : [];
  return { mode, allow };
}

export function sandboxInfoFromWire(obj: unknown): SandboxInfo {
  if (!isRecord(obj) || typeof obj.id !== 'string') {
    throw new TransportError(`expected a sandbox object with an 'id', the server sent ${JSON.stringify(obj)?.slice(0, 300)}`);
  }
  const metadata: Record<string, string> = {};
  if (isRecord(obj.metadata)) {
    for (const [k, v] of Object.entries(obj.metadata)) metadata[k] = String(v);
  }
  return {
    id: obj.id,
    template: String(obj.template ?? ''),
    state: String(obj.state ?? ''),
    createdAt: typeof obj.created_at === 'string' ? obj.created_at : null,
    lastActiveAt: typeof obj.last_active_at === 'string' ? obj.last_active_at : null,
    idleTimeoutSeconds: typeof obj.idle_timeout_seconds === 'number' ? obj.idle_timeout_seconds : null,
    metadata,
    network: networkFromWire(obj.network),
  };
}

export function resultFromWire(event: Record<string, unknown>): Result {
  const data = event.data ?? {};
  const metadata = event.metadata ?? {};
  if (!isRecord(data) || !isRecord(metadata)) {
    throw new TransportError(`the server sent a malformed result event: ${JSON.stringify(event).slice(0, 300)}`);
  }
  return { data, metadata, isMainResult: Boolean(event.is_main_result) };
}

export function errorFromWire(event: Record<string, unknown>): ExecutionError {
  return {
    name: String(event.name ?? ''),
    value: String(event.value ?? ''),
    traceback: Array.isArray(event.traceback) ? event.traceback.map(String) : [],
  };
}

/** A fresh, empty execution. */
export function newExecution(): Execution {
  return {
    stdout: '',
    stderr: '',
    results: [],
    error: null,
    executionCount: null,
    durationMs: null,
    status: 'ok',
    exitCode: null,
    outputTruncated: false,
    get text(): string | null {
      const main = this.results.find((r) => r.isMainResult);
      const value = main?.data['text/plain'];
      return typeof value === 'string' ? value : null;
    },
  };
}

/** A file or directory in a sandbox; `type` is `file`, `dir`, `symlink` or `other`. */
export interface FileInfo {
  name: string;
  path: string;
  type: string;
  size: number;
  modifiedAt: string | null;
}

export function fileInfoFromWire(obj: unknown): FileInfo {
  if (!isRecord(obj) || typeof obj.path !== 'string') {
    throw new TransportError(`expected a file entry with a 'path', the server sent ${JSON.stringify(obj)?.slice(0, 300)}`);
  }
  return {
    name: typeof obj.name === 'string' ? obj.name : obj.path.replace(/\/+$/, '').split('/').pop() ?? obj.path,
    path: obj.path,
    type: typeof obj.type === 'string' ? obj.type : 'file',
    size: typeof obj.size === 'number' ? obj.size : 0,
    modifiedAt: typeof obj.modified_at === 'string' ? obj.modified_at : null,
  };
}
