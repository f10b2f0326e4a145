/** Values the client returns: sandbox records and the outcome of running code. */

import { TransportError } from './errors.js';

/** What a sandbox is: its VM runs, is saved to disk, is being replaced, or stopped. */
export const SANDBOX_STATES = ['starting', 'running', 'hibernated', 'replacing', 'dead'] as const;
export type SandboxState = (typeof SANDBOX_STATES)[number];

/**
 * How an execution ended: `ok`, `error` (the code raised, or a bash command exited non-zero),
 * `timeout`, `interrupted`, `restarted` (a restart request ended it), `restored` (the sandbox was
 * rewound to a checkpoint meanwhile) or `kernel_died`.
 */
export const EXECUTION_STATUSES = ['ok', 'error', 'timeout', 'interrupted', 'restarted', 'restored', 'kernel_died'] as const;
export type ExecutionStatus = (typeof EXECUTION_STATUSES)[number];

/**
 * What the server did to bring a sandbox back: `interrupted` (state kept), `killed` (a bash
 * command's processes), `kernel_restarted`, `vm_replaced` (files lost too) or `failed`.
 */
export const RECOVERIES = ['interrupted', 'killed', 'kernel_restarted', 'vm_replaced', 'failed'] as const;
export type Recovery = (typeof RECOVERIES)[number];

function oneOf<T extends string>(values: readonly T[], value: unknown, fallback: T): T {
  return values.includes(value as T) ? (value as T) : fallback;
}

/** The status of an `end` event; one this client does not know counts as `error`. */
export function statusFromWire(value: unknown): ExecutionStatus {
  return oneOf(EXECUTION_STATUSES, value ?? 'ok', 'error');
}

export function recoveryFromWire(value: unknown): Recovery | null {
  return value === null || value === undefined ? null : oneOf(RECOVERIES, value, 'failed');
}

/** A sandbox as the server describes it (`GET /v1/sandboxes/{id}`). */
export interface SandboxInfo {
  id: string;
  template: string;
  state: SandboxState;
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
  /**
   * Names a display that can change (`display(..., display_id=True)`, progress bars): `onResult`
   * gets each new version with `isUpdate` true, and `Execution.results` keeps the latest one.
   */
  displayId: string | null;
  isUpdate: boolean;
}

/** An exception raised by the code that ran in the sandbox (not a client error). */
export interface ExecutionError {
  name: string;
  value: string;
  traceback: string[];
}

/** Everything one `runCode` call produced: see `ExecutionStatus` and `Recovery`. */
export interface Execution {
  stdout: string;
  stderr: string;
  results: Result[];
  error: ExecutionError | null;
  executionCount: number | null;
  durationMs: number | null;
  status: ExecutionStatus;
  /** What brought the sandbox back after a timeout or a loss; null when nothing was needed. */
  recovery: Recovery | null;
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
    state: oneOf(SANDBOX_STATES, obj.state, 'dead'),
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
  const displayId = event.display_id;
  return {
    data,
    metadata,
    isMainResult: Boolean(event.is_main_result),
    displayId: displayId === undefined || displayId === null ? null : String(displayId),
    isUpdate: event.type === 'update_display',
  };
}

/** Add a result to `results`, or put a display's new version where its first one is. */
export function keepResult(results: Result[], result: Result): void {
  if (!result.isUpdate) {
    results.push(result);
    return;
  }
  results.forEach((old, i) => {
    if (old.displayId === result.displayId) results[i] = result;
  });
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
    recovery: null,
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

/** A sandbox's whole state kept on the server: `restore` rewinds to it, `create({ checkpoint })` branches. */
export interface Checkpoint {
  id: string;
  sandboxId: string;
  label: string;
  createdAt: string;
  /** On the server's disk, compressed (only what differs from the template). */
  bytes: number;
  /** Taken by `autoCheckpoint` before a call (`beforeCall` numbers it). */
  auto: boolean;
  beforeCall: number | null;
}

export function checkpointFromWire(obj: unknown): Checkpoint {
  if (!isRecord(obj) || typeof obj.id !== 'string') {
    throw new TransportError(`expected a checkpoint object, the server sent ${JSON.stringify(obj)?.slice(0, 300)}`);
  }
  return {
    id: obj.id,
    sandboxId: String(obj.sandbox_id ?? ''),
    label: String(obj.label ?? ''),
    createdAt: String(obj.created_at ?? ''),
    bytes: Number(obj.bytes ?? 0),
    auto: Boolean(obj.auto),
    beforeCall: typeof obj.before_call === 'number' ? obj.before_call : null,
  };
}

/** One sample of a sandbox's CPU, memory and disk (`Sandbox.getMetrics`). */
export interface SandboxMetrics {
  /** ISO 8601, UTC */
  timestamp: string;
  timestampUnix: number;
  cpuCount: number;
  /** Of all its vCPUs since the previous sample; null for the first sample of a VM. */
  cpuUsedPct: number | null;
  /** CPU time of the sandbox's current VM. */
  cpuSeconds: number;
  /** What its VM holds on the host. */
  hostMemoryBytes: number;
  /** Bytes as the guest reports them; null when it did not answer in time. */
  memTotal: number | null;
  memUsed: number | null;
  memCache: number | null;
  /** Its writable space (held in its RAM). */
  diskUsed: number | null;
  diskTotal: number | null;
}

export function metricsFromWire(obj: unknown): SandboxMetrics {
  if (!isRecord(obj) || typeof obj.timestamp_unix !== 'number') {
    throw new TransportError(`expected a metrics sample, the server sent ${JSON.stringify(obj)?.slice(0, 300)}`);
  }
  const count = (v: unknown): number | null => (typeof v === 'number' ? v : null);
  return {
    timestamp: String(obj.timestamp ?? ''),
    timestampUnix: obj.timestamp_unix,
    cpuCount: Number(obj.cpu_count ?? 0),
    cpuUsedPct: count(obj.cpu_used_pct),
    cpuSeconds: Number(obj.cpu_seconds ?? 0),
    hostMemoryBytes: Number(obj.host_memory_bytes ?? 0),
    memTotal: count(obj.mem_total),
    memUsed: count(obj.mem_used),
    memCache: count(obj.mem_cache),
    diskUsed: count(obj.disk_used),
    diskTotal: count(obj.disk_total),
  };
}

export function checkpointId(cp: Checkpoint | string): string {
  const id = typeof cp === 'string' ? cp : cp?.id;
  if (!id) throw new TypeError(`expected a Checkpoint or a checkpoint id such as 'cp_...', got ${JSON.stringify(cp)}`);
  return id;
}
