/**
 * What the framework adapters share: running code (or a bash command) for a model, and the
 * sandbox an adapter creates on first use.
 */

import { APIError, AuthenticationError, KernelHostError, NotFoundError } from './errors.js';
import type { ClientOptions } from './http.js';
import { DEFAULT_BUDGET, type Image, type OutputBudget, shapeExecution } from './output.js';
import { Sandbox } from './sandbox.js';

/** The languages the adapters offer: Python runs in the kernel, bash as a command from it. */
export const LANGUAGES = ['python', 'bash'] as const;
export type Language = (typeof LANGUAGES)[number];

/** Seconds a tool call may run before the sandbox interrupts it, unless configured. */
export const DEFAULT_TIMEOUT_SECONDS = 120;

/** What a text-and-images tool hands a model. */
export interface ToolOutput {
  text: string;
  images: Image[];
  isError: boolean;
}

/**
 * Re-throw errors the developer must fix (a bad API key, a closed sandbox); return for
 * failures a model should be told of (service unreachable, busy, sandbox gone).
 */
export function serviceFailure(error: unknown): void {
  if (error instanceof AuthenticationError) throw error;
  if (!(error instanceof KernelHostError) || error.constructor === KernelHostError) throw error;
}

/** Run Python code or a bash command and shape what it produced for a model. */
export async function runForModel(
  sandbox: Sandbox,
  source: string,
  language: string,
  timeoutSeconds: number | undefined,
  budget: OutputBudget = DEFAULT_BUDGET,
): Promise<ToolOutput> {
  if (!(LANGUAGES as readonly string[]).includes(language)) {
    return { text: `Unknown language ${JSON.stringify(language)}: use one of ${LANGUAGES.join(', ')}.`, images: [], isError: true };
  }
  const options = { language, ...(timeoutSeconds === undefined ? {} : { timeoutSeconds }) };
  try {
    const shaped = shapeExecution(await sandbox.runCode(source, options), budget);
    return { text: shaped.toText(), images: shaped.images, isError: shaped.isError };
  } catch (error) {
    serviceFailure(error);
    return { text: `The sandbox service failed, so the code did not run: ${(error as Error).message}`, images: [], isError: true };
  }
}

/**
 * What is at a path of the sandbox, from its directory's listing: `missing` means "not in the
 * listing" (a listing is capped, so callers that must be sure try the operation itself).
 */
export interface PathStat {
  path: string;
  kind: 'file' | 'dir' | 'other' | 'missing';
  size: number;
}

export async function statPath(sandbox: Sandbox, path: string): Promise<PathStat> {
  const stripped = path.replace(/\/+$/, '');
  if (!stripped) return { path: '/', kind: 'dir', size: 0 };
  const slash = stripped.lastIndexOf('/');
  const name = stripped.slice(slash + 1);
  const parent = slash < 0 ? '.' : slash === 0 ? '/' : stripped.slice(0, slash);
  let entries;
  try {
    entries = await sandbox.files.list(parent);
  } catch (error) {
    if (error instanceof NotFoundError) return { path, kind: 'missing', size: 0 };
    if (error instanceof APIError && error.code === 'file_operation_failed') return { path, kind: 'missing', size: 0 };
    throw error;
  }
  const entry = entries.find((e) => e.name === name);
  if (!entry) return { path, kind: 'missing', size: 0 };
  const kind = entry.type === 'file' || entry.type === 'dir' ? entry.type : 'other';
  return { path: entry.path, kind, size: entry.size };
}

/** Options of the adapters that create their sandbox on first use. */
export interface LazySandboxOptions extends ClientOptions {
  /** Use this sandbox (the adapter will not close it). */
  sandbox?: Sandbox;
  /** Template of the sandbox the adapter creates (default `python`). */
  template?: string;
  /** The server deletes the created sandbox after this long unused. */
  idleTimeoutSeconds?: number;
}

/** The adapter's sandbox: the caller's, or one created on first use and deleted by close(). */
export class LazySandbox {
  readonly #options: LazySandboxOptions;
  #created: Promise<Sandbox> | null = null;

  constructor(options: LazySandboxOptions) {
    this.#options = options;
  }

  get(): Promise<Sandbox> {
    if (this.#options.sandbox) return Promise.resolve(this.#options.sandbox);
    if (!this.#created) {
      const { template = 'python', idleTimeoutSeconds, url, apiKey } = this.#options;
      this.#created = Sandbox.create({
        template,
        metadata: { created_by: 'kernelhost-js' },
        ...(idleTimeoutSeconds === undefined ? {} : { idleTimeoutSeconds }),
        ...(url === undefined ? {} : { url }),
        ...(apiKey === undefined ? {} : { apiKey }),
      });
      this.#created.catch(() => {
        this.#created = null; // let the next call try again
      });
    }
    return this.#created;
  }

  /** Delete the sandbox this adapter created, if any. */
  async close(): Promise<void> {
    const created = this.#created;
    this.#created = null;
    if (!created) return;
    let sandbox: Sandbox;
    try {
      sandbox = await created;
    } catch {
      return; // it was never created: nothing to delete (its call reported the error)
    }
    await sandbox.close();
  }
}
