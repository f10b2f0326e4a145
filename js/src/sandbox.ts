/**
 * `Sandbox`: a VM on a kernelhost server running a Jupyter kernel that keeps its state.
 *
 * ```ts
 * import { Sandbox } from 'kernelhost';
 *
 * const sbx = await Sandbox.create({ template: 'python' });
 * try {
 *   const execution = await sbx.runCode("print('hi')\n1 + 1", { onStdout: (t) => process.stdout.write(t) });
 *   console.log(execution.text); // "2"
 * } finally {
 *   await sbx.close();
 * }
 * ```
 */

import { KernelHostError, NotFoundError, TransportError, errorForStatus } from './errors.js';
import { type ClientOptions, type Config, request, requestBytes, resolveConfig, stream } from './http.js';
import {
  type Execution,
  type ExecutionError,
  type FileInfo,
  type NetworkMode,
  type Recovery,
  type Result,
  type SandboxInfo,
  type SandboxMetrics,
  errorFromWire,
  fileInfoFromWire,
  type Checkpoint,
  checkpointFromWire,
  checkpointId,
  keepResult,
  metricsFromWire,
  newExecution,
  recoveryFromWire,
  resultFromWire,
  sandboxInfoFromWire,
  statusFromWire,
} from './models.js';

/** Default deadline for creating a sandbox (a VM may boot), in milliseconds. */
export const CREATE_TIMEOUT_MS = 120_000;
/** Added to runCode's `timeoutSeconds` for the HTTP deadline: the server stops the code itself. */
export const EXECUTE_DEADLINE_MARGIN_MS = 30_000;
/** Deadline for restarting the kernel, in milliseconds. */
export const RESTART_TIMEOUT_MS = 120_000;
/** Deadline of a checkpoint or a restore (a whole VM is saved or loaded), in milliseconds. */
export const RESTORE_TIMEOUT_MS = 300_000;
/** Deadline of one file transfer, in milliseconds. */
export const FILE_TIMEOUT_MS = 600_000;

export interface CreateOptions extends ClientOptions {
  /** The image to boot (default `python`). */
  template?: string;
  /** The server deletes the sandbox after this long unused (default: the server's). */
  idleTimeoutSeconds?: number;
  /** Stored with the sandbox. */
  metadata?: Record<string, string>;
  /**
   * Network mode: `'none'` (default: no network), `'allowlist'` (the server's package indexes,
   * so `pip install` works, plus `allow` entries), `'outbound'` (any public host), or
   * `{ mode: 'allowlist', allow: ['host:443'] }`.
   */
  network?: NetworkMode | { mode: NetworkMode; allow?: string[] };
  /** Bounds the whole creation, boot included (default 120 s). */
  timeoutMs?: number;
  /** Keep the state before each call so `undo()` can rewind it (true: the last 5 calls). */
  autoCheckpoint?: boolean | number;
  /** Start from a checkpoint's state instead of a fresh template (a branch). */
  checkpoint?: Checkpoint | string;
}

export interface RunCodeOptions {
  /** `python` (default) or `bash`. */
  language?: string;
  /** Seconds the server lets the code run before interrupting it (status `timeout`). */
  timeoutSeconds?: number;
  /** Called with each piece of stdout as it arrives, before runCode resolves. */
  onStdout?: (text: string) => unknown;
  onStderr?: (text: string) => unknown;
  onResult?: (result: Result) => unknown;
  onError?: (error: ExecutionError) => unknown;
  /** Aborting it stops waiting; the server then interrupts the code. */
  signal?: AbortSignal;
}

/**
 * Files inside a sandbox, over the HTTP API. The filesystem is the one its code sees; relative
 * paths are under `/home/user`, the kernel's working directory.
 */
export interface SandboxFiles {
  /** The file's bytes; `NotFoundError` (code `file_not_found`) if there is none. */
  read(path: string): Promise<Uint8Array>;
  /** The file as UTF-8 text. */
  readText(path: string): Promise<string>;
  /** Write a file (text as UTF-8), replacing any; its directories are created. */
  write(path: string, data: string | Uint8Array): Promise<FileInfo>;
  /** The entries of a directory (default `/home/user`), sorted by name. */
  list(path?: string): Promise<FileInfo[]>;
  /** Remove a file or empty directory (`recursive`: any directory). */
  remove(path: string, options?: { recursive?: boolean }): Promise<void>;
}

function sandboxPath(id: string, action = ''): string {
  const path = `/v1/sandboxes/${encodeURIComponent(id)}`;
  return action ? `${path}/${action}` : path;
}

export class Sandbox {
  readonly #config: Config;
  #info: SandboxInfo;
  #closed = false;
  /** Files inside the sandbox (through its kernel). */
  readonly files: SandboxFiles;

  private constructor(config: Config, info: SandboxInfo) {
    this.#config = config;
    this.#info = info;
    const files = (): string => {
      this.#ensureOpen();
      return sandboxPath(this.id, 'files');
    };
    const checked = (path: string): string => {
      if (typeof path !== 'string' || !path) {
        throw new TypeError(`path must be a non-empty string such as 'data.csv' or '/tmp/out.png', got ${JSON.stringify(path)}`);
      }
      return path;
    };
    this.files = {
      read: async (path) =>
        requestBytes(this.#config, 'GET', files(), { query: { path: checked(path) }, timeoutMs: FILE_TIMEOUT_MS }),
      readText: async (path) => new TextDecoder().decode(await this.files.read(path)),
      write: async (path, data) => {
        const bytes = typeof data === 'string' ? new TextEncoder().encode(data) : data;
        const reply = await request(this.#config, 'PUT', files(), {
          query: { path: checked(path) },
          bytes,
          timeoutMs: FILE_TIMEOUT_MS,
        });
        return fileInfoFromWire({ type: 'file', ...(reply as object) });
      },
      list: async (path = '.') => {
        const reply = await request(this.#config, 'GET', `${files()}/list`, { query: { path: checked(path) } });
        const entries = (reply as { entries?: unknown })?.entries;
        if (!Array.isArray(entries)) {
          throw new TransportError(`files/list answered without an 'entries' list: ${JSON.stringify(reply)?.slice(0, 300)}`);
        }
        return entries.map(fileInfoFromWire);
      },
      remove: async (path, options = {}) => {
        await request(this.#config, 'DELETE', files(), {
          query: { path: checked(path), recursive: options.recursive ? 'true' : 'false' },
        });
      },
    };
  }

  /** Create a sandbox on the server (a VM boots or is taken from the warm pool). */
  static async create(options: CreateOptions = {}): Promise<Sandbox> {
    const config = resolveConfig(options);
    const body: Record<string, unknown> = {
      template: options.template ?? 'python',
      metadata: options.metadata ?? {},
    };
    if (options.idleTimeoutSeconds !== undefined) body.idle_timeout_seconds = options.idleTimeoutSeconds;
    if (options.network !== undefined) body.network = options.network;
    if (options.autoCheckpoint) body.auto_checkpoint = options.autoCheckpoint;
    if (options.checkpoint !== undefined) body.checkpoint = checkpointId(options.checkpoint);
    const created = await request(config, 'POST', '/v1/sandboxes', {
      body,
      timeoutMs: options.timeoutMs ?? CREATE_TIMEOUT_MS,
    });
    return new Sandbox(config, sandboxInfoFromWire(created));
  }

  /** Attach to an existing sandbox by id (throws `NotFoundError` if there is none). */
  static async connect(id: string, options: ClientOptions = {}): Promise<Sandbox> {
    if (!id) throw new TypeError(`id must be a sandbox's id such as 'sbx_...', got ${JSON.stringify(id)}`);
    const config = resolveConfig(options);
    return new Sandbox(config, sandboxInfoFromWire(await request(config, 'GET', sandboxPath(id))));
  }

  /** The sandboxes that belong to the API key. */
  static async list(options: ClientOptions = {}): Promise<SandboxInfo[]> {
    const payload = await request(resolveConfig(options), 'GET', '/v1/sandboxes');
    const items = (payload as { sandboxes?: unknown })?.sandboxes;
    if (!Array.isArray(items)) {
      throw new TransportError(`GET /v1/sandboxes answered without a 'sandboxes' list: ${JSON.stringify(payload)?.slice(0, 300)}`);
    }
    return items.map(sandboxInfoFromWire);
  }

  /** The sandbox's id, `sbx_...`. */
  get id(): string {
    return this.#info.id;
  }

  /** The sandbox's record as last fetched. */
  get info(): SandboxInfo {
    return this.#info;
  }

  /** Fetch the sandbox's current record from the server. */
  async getInfo(): Promise<SandboxInfo> {
    this.#ensureOpen();
    this.#info = sandboxInfoFromWire(await request(this.#config, 'GET', sandboxPath(this.id)));
    return this.#info;
  }

  #ensureOpen(): void {
    if (this.#closed) throw new KernelHostError(`sandbox ${this.id} is closed; create a new sandbox to run code`);
  }

  /**
   * Run code in the sandbox's kernel and return everything it produced; state persists between
   * calls. A failing cell does not throw: see `Execution.error` and `Execution.status`.
   * Callbacks are called with each output as it arrives.
   */
  async runCode(code: string, options: RunCodeOptions = {}): Promise<Execution> {
    this.#ensureOpen();
    const timeout = options.timeoutSeconds;
    if (timeout !== undefined && !(timeout > 0)) {
      throw new RangeError(`timeoutSeconds=${timeout}: use a positive number of seconds, or leave it out`);
    }
    const execution = newExecution();
    const body = { code, language: options.language ?? 'python', timeout: timeout ?? null };
    const events = stream(this.#config, 'POST', sandboxPath(this.id, 'execute'), {
      body,
      timeoutMs: timeout === undefined ? null : timeout * 1000 + EXECUTE_DEADLINE_MARGIN_MS,
      ...(options.signal ? { signal: options.signal } : {}),
    });
    for await (const event of events) {
      switch (event.type) {
        case 'stdout': {
          const text = String(event.text ?? '');
          execution.stdout += text;
          await options.onStdout?.(text);
          break;
        }
        case 'stderr': {
          const text = String(event.text ?? '');
          execution.stderr += text;
          await options.onStderr?.(text);
          break;
        }
        case 'result':
        case 'update_display': {
          const result = resultFromWire(event);
          keepResult(execution.results, result);
          await options.onResult?.(result);
          break;
        }
        case 'error':
          execution.error = errorFromWire(event);
          await options.onError?.(execution.error);
          break;
        case 'failure': {
          // the service failed after the stream began (a wake refused, say)
          const status = typeof event.status === 'number' ? event.status : 500;
          throw errorForStatus(status, { error: event.error }, `POST ${sandboxPath(this.id, 'execute')}`);
        }
        case 'end':
          execution.status = statusFromWire(event.status);
          execution.recovery = recoveryFromWire(event.recovery);
          execution.exitCode = typeof event.exit_code === 'number' ? event.exit_code : null;
          execution.outputTruncated = event.output_truncated === true;
          execution.executionCount = typeof event.execution_count === 'number' ? event.execution_count : null;
          execution.durationMs = typeof event.duration_ms === 'number' ? event.duration_ms : null;
          return execution;
        default:
          break; // a type from a newer server: ignored on purpose
      }
    }
    throw new TransportError(
      `the execution stream of sandbox ${this.id} ended before its 'end' event (${execution.stdout.length} characters of stdout had arrived); the server may have restarted or dropped the connection`,
    );
  }

  /**
   * Interrupt the running call (like Jupyter's stop button); state is kept. Python gets a
   * KeyboardInterrupt, a bash command SIGINT; the call ends with status `interrupted`. Does not
   * wait behind the running call. Resolves false if nothing ran.
   */
  async interrupt(): Promise<boolean> {
    this.#ensureOpen();
    const reply = await request(this.#config, 'POST', sandboxPath(this.id, 'interrupt'));
    return Boolean((reply as { interrupted?: unknown } | null)?.interrupted);
  }

  /**
   * Restart the kernel and reset the shell: running code stops, variables are lost, files are
   * kept (unless the VM was dead: then it is replaced). Resolves `kernel_restarted` or
   * `vm_replaced`.
   */
  async restart(): Promise<Recovery> {
    this.#ensureOpen();
    const reply = await request(this.#config, 'POST', sandboxPath(this.id, 'restart'), { timeoutMs: RESTART_TIMEOUT_MS });
    return recoveryFromWire((reply as { recovery?: unknown } | null)?.recovery) ?? 'kernel_restarted';
  }

  /**
   * Copy this sandbox, live, into `n` new sandboxes: each starts with every variable, import and
   * file the parent has now; afterwards they are independent and each is closed on its own.
   */
  async fork(n = 1, options: { timeoutMs?: number } = {}): Promise<Sandbox[]> {
    this.#ensureOpen();
    if (!Number.isInteger(n) || n < 1) throw new RangeError(`n must be a positive integer (how many children), got ${n}`);
    const payload = await request(this.#config, 'POST', sandboxPath(this.id, 'fork'), {
      body: { n },
      timeoutMs: options.timeoutMs ?? CREATE_TIMEOUT_MS,
    });
    const items = (payload as { sandboxes?: unknown })?.sandboxes;
    if (!Array.isArray(items)) {
      throw new TransportError(`fork answered without a 'sandboxes' list: ${JSON.stringify(payload)?.slice(0, 300)}`);
    }
    return items.map((item) => new Sandbox(this.#config, sandboxInfoFromWire(item)));
  }

  /**
   * Keep the sandbox's whole state now (variables, imports, files, the shell), to `restore` it
   * or start new sandboxes from it; the sandbox is paused only while it is saved.
   */
  async checkpoint(label?: string): Promise<Checkpoint> {
    this.#ensureOpen();
    const body = label === undefined ? {} : { label };
    const reply = await request(this.#config, 'POST', sandboxPath(this.id, 'checkpoints'), { body, timeoutMs: RESTORE_TIMEOUT_MS });
    return checkpointFromWire(reply);
  }

  /** The sandbox's checkpoints, oldest first. */
  async checkpoints(): Promise<Checkpoint[]> {
    this.#ensureOpen();
    const payload = await request(this.#config, 'GET', sandboxPath(this.id, 'checkpoints'));
    const items = (payload as { checkpoints?: unknown })?.checkpoints;
    if (!Array.isArray(items)) throw new TransportError(`the checkpoint list came without a 'checkpoints' list`);
    return items.map(checkpointFromWire);
  }

  /**
   * The sandbox's CPU, memory and disk samples from `start` to `end` (Dates or Unix seconds;
   * default: all the server keeps), oldest first. Empty while none were taken.
   */
  async getMetrics(start?: Date | number, end?: Date | number): Promise<SandboxMetrics[]> {
    this.#ensureOpen();
    const query = new URLSearchParams();
    for (const [name, when] of [['start', start], ['end', end]] as const) {
      if (when !== undefined) query.set(name, String(when instanceof Date ? when.getTime() / 1000 : when));
    }
    const qs = query.toString();
    const path = sandboxPath(this.id, 'metrics') + (qs ? `?${qs}` : '');
    const payload = await request(this.#config, 'GET', path);
    const items = (payload as { samples?: unknown })?.samples;
    if (!Array.isArray(items)) throw new TransportError(`the metrics came without a 'samples' list`);
    return items.map(metricsFromWire);
  }

  /** Delete one of the sandbox's checkpoints. */
  async deleteCheckpoint(cp: Checkpoint | string): Promise<void> {
    this.#ensureOpen();
    await request(this.#config, 'DELETE', sandboxPath(this.id, `checkpoints/${checkpointId(cp)}`));
  }

  /**
   * Rewind this sandbox to one of its checkpoints: every variable, import and file as it was
   * then (same id). A call running meanwhile ends with status `restored`.
   */
  async restore(cp: Checkpoint | string): Promise<Checkpoint> {
    this.#ensureOpen();
    return this.#rewind('restore', { checkpoint: checkpointId(cp) });
  }

  /** Rewind to before the `n`-th last `runCode` call (the sandbox needs `autoCheckpoint`). */
  async undo(n = 1): Promise<Checkpoint> {
    this.#ensureOpen();
    if (!Number.isInteger(n) || n < 1) throw new RangeError(`n must be a positive integer (calls to undo), got ${n}`);
    return this.#rewind('undo', { n });
  }

  async #rewind(action: string, body: Record<string, unknown>): Promise<Checkpoint> {
    const reply = await request(this.#config, 'POST', sandboxPath(this.id, action), { body, timeoutMs: RESTORE_TIMEOUT_MS });
    return checkpointFromWire((reply as { checkpoint?: unknown } | null)?.checkpoint);
  }

  /** Delete the sandbox and everything in it. Safe to call more than once. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    try {
      await request(this.#config, 'DELETE', sandboxPath(this.id));
    } catch (error) {
      if (!(error instanceof NotFoundError)) throw error; // already gone: the goal is met
    }
  }

}
