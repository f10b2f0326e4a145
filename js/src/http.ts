/**
 * The client's HTTP layer: configuration, JSON requests, NDJSON streams, error mapping.
 * Every request has a deadline; callers only ever see the errors of `errors.ts`.
 */

import {
  AuthenticationError,
  KernelHostError,
  KernelHostTimeout,
  TransportError,
  errorForStatus,
} from './errors.js';

export const DEFAULT_URL = 'http://127.0.0.1:8999';
export const URL_ENV = 'KERNELHOST_URL';
export const API_KEY_ENV = 'KERNELHOST_API_KEY';
/** Deadline for short calls (get, list, delete), in milliseconds. */
export const REQUEST_TIMEOUT_MS = 30_000;
/** The longest NDJSON line accepted (a result event carries whole images as base64). */
export const MAX_EVENT_BYTES = 256 * 1024 * 1024;

/** Where the service is and how to authenticate. */
export interface ClientOptions {
  /** Default: `KERNELHOST_URL`, else `http://127.0.0.1:8999`. */
  url?: string;
  /** Default: `KERNELHOST_API_KEY`. */
  apiKey?: string;
}

export interface Config {
  url: string;
  apiKey: string;
}

/** Apply the defaults; throws `AuthenticationError` when there is no key, before any request. */
export function resolveConfig(options: ClientOptions = {}): Config {
  const base = options.url ?? process.env[URL_ENV] ?? DEFAULT_URL;
  if (!/^https?:\/\//.test(base)) {
    const source = options.url ? 'url' : URL_ENV;
    throw new TypeError(`${source} is ${JSON.stringify(base)}, which is not an http(s) URL; use the form 'http://127.0.0.1:8999'`);
  }
  const apiKey = options.apiKey ?? process.env[API_KEY_ENV];
  if (!apiKey) {
    throw new AuthenticationError(
      "no API key: pass apiKey or set the KERNELHOST_API_KEY environment variable ('kernelhost serve' prints a key the first time it starts)",
      null,
      'missing_api_key',
    );
  }
  return { url: base.replace(/\/+$/, ''), apiKey };
}

function deadline(timeoutMs: number | null, signal?: AbortSignal): AbortSignal | undefined {
  const signals: AbortSignal[] = [];
  if (timeoutMs !== null) signals.push(AbortSignal.timeout(timeoutMs));
  if (signal) signals.push(signal);
  return signals.length === 0 ? undefined : signals.length === 1 ? signals[0] : AbortSignal.any(signals);
}

function translate(error: unknown, what: string, config: Config, timeoutMs: number | null, signal?: AbortSignal): KernelHostError {
  if (error instanceof KernelHostError) return error;
  const err = error as { name?: string; cause?: { code?: string; message?: string }; message?: string };
  if (err?.name === 'TimeoutError') {
    const within = timeoutMs === null ? '' : ` within ${timeoutMs / 1000} s`;
    return new KernelHostTimeout(`${what} to ${config.url} got no complete answer${within}; pass a larger timeout if the work is expected to take longer`);
  }
  if (err?.name === 'AbortError' && signal?.aborted) {
    return new KernelHostError(`${what} was aborted by the caller's signal`);
  }
  const cause = err?.cause?.code ?? err?.cause?.message ?? err?.message ?? String(error);
  return new TransportError(`cannot reach kernelhost at ${config.url} for ${what} (${cause}); is the server running? Start it with 'make serve' (or 'kernelhost serve'), or point ${URL_ENV} / url at a running one`);
}

async function errorFrom(response: Response, what: string): Promise<KernelHostError> {
  const text = await response.text();
  let body: unknown = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = { error: { code: 'http_error', message: text.slice(0, 500) || response.statusText } };
  }
  return errorForStatus(response.status, body, what);
}

function headers(config: Config, extra: Record<string, string> = {}): Record<string, string> {
  return { Authorization: `Bearer ${config.apiKey}`, 'User-Agent': 'kernelhost-js/0.1.0', ...extra };
}

export interface RequestOptions {
  /** A JSON body. */
  body?: unknown;
  /** A raw body (sent as application/octet-stream). */
  bytes?: Uint8Array;
  /** Query parameters. */
  query?: Record<string, string>;
  /** Deadline of the whole exchange, in milliseconds (default 30 s). */
  timeoutMs?: number;
}

function target(config: Config, path: string, query?: Record<string, string>): string {
  const qs = query ? `?${new URLSearchParams(query).toString()}` : '';
  return config.url + path + qs;
}

async function send(config: Config, method: string, path: string, options: RequestOptions): Promise<Response> {
  const what = `${method} ${path}`;
  const timeoutMs = options.timeoutMs ?? REQUEST_TIMEOUT_MS;
  const extra: Record<string, string> = {};
  const init: RequestInit = { method, signal: deadline(timeoutMs) ?? null };
  if (options.bytes !== undefined) {
    extra['Content-Type'] = 'application/octet-stream';
    init.body = options.bytes;
  } else if (options.body !== undefined) {
    extra['Content-Type'] = 'application/json';
    init.body = JSON.stringify(options.body);
  }
  init.headers = headers(config, extra);
  let response: Response;
  try {
    response = await fetch(target(config, path, options.query), init);
  } catch (error) {
    throw translate(error, what, config, timeoutMs);
  }
  if (!response.ok) throw await errorFrom(response, what);
  return response;
}

/** Send a request and return its decoded JSON body (null for an empty body). */
export async function request(config: Config, method: string, path: string, options: RequestOptions = {}): Promise<unknown> {
  const what = `${method} ${path}`;
  const response = await send(config, method, path, options);
  let text: string;
  try {
    text = await response.text();
  } catch (error) {
    throw translate(error, what, config, options.timeoutMs ?? REQUEST_TIMEOUT_MS);
  }
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    throw new TransportError(`the response to ${what} is not valid JSON: ${text.slice(0, 200)}`);
  }
}

/** Send a request and return its body's bytes. */
export async function requestBytes(config: Config, method: string, path: string, options: RequestOptions = {}): Promise<Uint8Array> {
  const response = await send(config, method, path, options);
  try {
    return new Uint8Array(await response.arrayBuffer());
  } catch (error) {
    throw translate(error, `${method} ${path}`, config, options.timeoutMs ?? REQUEST_TIMEOUT_MS);
  }
}

/**
 * Send a request and yield the objects of its NDJSON response as they arrive. `timeoutMs`
 * bounds the whole exchange (null: unbounded); `signal` aborts it.
 */
export async function* stream(
  config: Config,
  method: string,
  path: string,
  options: { body: unknown; timeoutMs: number | null; signal?: AbortSignal },
): AsyncGenerator<Record<string, unknown>> {
  const what = `${method} ${path}`;
  const signal = deadline(options.timeoutMs, options.signal);
  let response: Response;
  try {
    response = await fetch(config.url + path, {
      method,
      headers: headers(config, { 'Content-Type': 'application/json', Accept: 'application/x-ndjson' }),
      body: JSON.stringify(options.body),
      signal: signal ?? null,
    });
  } catch (error) {
    throw translate(error, what, config, options.timeoutMs, options.signal);
  }
  if (!response.ok) throw await errorFrom(response, what);
  if (!response.body) throw new TransportError(`the response to ${what} has no body`);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      let chunk: Awaited<ReturnType<typeof reader.read>>;
      try {
        chunk = await reader.read();
      } catch (error) {
        throw translate(error, what, config, options.timeoutMs, options.signal);
      }
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      let newline: number;
      while ((newline = buffer.indexOf('\n')) >= 0) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (line.trim()) yield decodeEvent(line, what);
      }
      if (buffer.length > MAX_EVENT_BYTES) {
        throw new TransportError(`an event in the response to ${what} exceeds ${MAX_EVENT_BYTES} bytes`);
      }
    }
    buffer += decoder.decode();
    if (buffer.trim()) yield decodeEvent(buffer, what);
  } finally {
    // Stop the body if the consumer leaves early: the server then interrupts the execution.
    await reader.cancel().catch(() => undefined);
  }
}

function decodeEvent(line: string, what: string): Record<string, unknown> {
  let event: unknown;
  try {
    event = JSON.parse(line);
  } catch {
    throw new TransportError(`the response to ${what} holds a line that is not JSON: ${line.slice(0, 200)}`);
  }
  if (typeof event !== 'object' || event === null || Array.isArray(event)) {
    throw new TransportError(`the response to ${what} holds a non-object line: ${line.slice(0, 200)}`);
  }
  return event as Record<string, unknown>;
}
